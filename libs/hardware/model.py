"""Plain data the hardware layer reports: GPUs, their NVLink fabric view, and health.

Values mirror NVML so both backends report the same thing: ``FabricState`` uses the
``NVML_GPU_FABRIC_STATE_*`` numbers and cluster UUIDs are the canonical lowercase form of NVML's
16-byte ``clusterUuid``.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass

ZERO_CLUSTER_UUID = str(uuid.UUID(int=0))
"""The cluster UUID NVML reports for a GPU that is not (yet) part of an NVLink fabric."""


class FabricState(enum.IntEnum):
    """``nvmlGpuFabricState_t``: where a GPU is in joining the NVLink fabric."""

    NOT_SUPPORTED = 0
    NOT_STARTED = 1
    IN_PROGRESS = 2
    COMPLETED = 3


class GpuHealth(enum.IntEnum):
    """Fabric health of a GPU, ordered so that ``max()`` gives the worst."""

    HEALTHY = 0
    DEGRADED = 1
    UNHEALTHY = 2

    @property
    def label(self) -> str:
        return self.name.capitalize()


@dataclass(frozen=True, slots=True)
class FabricInfo:
    """One GPU's NVLink fabric information (NVML ``nvmlGpuFabricInfo``)."""

    cluster_uuid: str
    clique_id: int
    state: FabricState
    status: int = 0
    """NVML return code of the fabric registration; only meaningful once COMPLETED (0 = success)."""
    health: GpuHealth = GpuHealth.HEALTHY

    @property
    def has_zero_cluster_uuid(self) -> bool:
        return self.cluster_uuid == ZERO_CLUSTER_UUID


@dataclass(frozen=True, slots=True)
class GpuInfo:
    uuid: str
    index: int
    memory_bytes: int
    fabric: FabricInfo

    @property
    def health(self) -> GpuHealth:
        return self.fabric.health
