"""The hardware port: what a node agent may ask of its node's GPUs and driver.

Two backends implement :class:`NodeHardware`: ``libs.hardware.nvml`` (real NVML) and
``tools.sim.hardware.simulated`` (one node of a simulated NVL72 cluster, loaded by name through
``libs.hardware.factory``). Queries are synchronous and cheap (NVML calls and small local files);
only the health event stream is async.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from libs.hardware.clique import CliqueResult, derive_clique_id
from libs.hardware.model import GpuHealth, GpuInfo

TYPE_CHECKING = False
if TYPE_CHECKING:
    from libs.hardware.off_loop import OffLoopCalls

ImexBackendName = Literal["nvidia", "simulated"]
"""Which IMEX daemon goes with this hardware: real ``nvidia-imex`` or the TCP simulator."""


@dataclass(frozen=True, slots=True)
class HardwareSnapshot:
    """Everything about a node's GPUs at one moment, with the clique derived from them."""

    gpus: tuple[GpuInfo, ...]
    clique: CliqueResult

    @classmethod
    def of(cls, gpus: tuple[GpuInfo, ...]) -> HardwareSnapshot:
        return cls(gpus=gpus, clique=derive_clique_id(gpus))

    @property
    def health(self) -> GpuHealth:
        """The worst GPU health on the node (HEALTHY for a node without GPUs)."""
        return max((g.health for g in self.gpus), default=GpuHealth.HEALTHY)


@dataclass(frozen=True, slots=True)
class HealthEvent:
    """The node's hardware changed (or could not be read); ``snapshot`` is the latest good view."""

    snapshot: HardwareSnapshot
    changes: tuple[str, ...]
    """One line per change, e.g. ``GPU-… (GPU 2): fabric state COMPLETED -> IN_PROGRESS``."""
    error: str = ""
    """Set when the hardware could not be queried; ``snapshot`` is then the last good one."""


@runtime_checkable
class NodeHardware(Protocol):
    @property
    def imex_backend(self) -> ImexBackendName: ...

    def gpus(self) -> tuple[GpuInfo, ...]:
        """All GPUs of the node in index order. Raises HardwareError when they cannot be read."""
        ...

    def snapshot(self) -> HardwareSnapshot:
        """GPUs plus the clique derived from them, read together."""
        ...

    def clique(self) -> CliqueResult:
        """``derive_clique_id`` over the current GPUs (PENDING while the fabric comes up)."""
        ...

    def driver_version(self) -> str: ...

    def imex_channel_major(self) -> int:
        """Major of ``nvidia-caps-imex-channels`` from this node's ``/proc/devices``.

        Raises ImexChannelsUnavailableError when the driver exposes no IMEX channels.
        """
        ...

    def imex_channel_path(self, channel: int) -> Path:
        """Host path of channel N: ``<dev root>/dev/nvidia-caps-imex-channels/channel<N>``."""
        ...

    def ensure_imex_channel_device(self, channel: int) -> Path:
        """Make sure channel N exists on the host (creating it if needed); returns its path."""
        ...

    def health_events(
        self,
        since: HardwareSnapshot | None = None,
        interval: float | None = None,
        calls: OffLoopCalls | None = None,
    ) -> AsyncGenerator[HealthEvent, None]:
        """Changes of GPU fabric state, clique or health relative to ``since``.

        Without ``since`` the baseline is read when iteration starts, so pass the snapshot you
        acted on to miss nothing in between.

        Runs until cancelled; a failed query is reported once as an event with ``error`` set.
        Queries run off the event loop through ``calls`` (a stalled one is a failed query).
        """
        ...

    def close(self) -> None:
        """Release the backend (NVML shutdown). Idempotent."""
        ...
