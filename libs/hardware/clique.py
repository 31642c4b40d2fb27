"""Derive a node's NVLink clique id from its GPUs' fabric information (pure).

The clique id is ``<clusterUUID>.<cliqueId>``, the value of the ``nvidia.com/gpu.clique`` label.
Transitional fabric states are a normal part of a node's boot (the fabric manager is still
configuring the NVLink switches), so they yield a PENDING result the caller can wait on; they must
never raise (upstream issue #1264 crashed the plugin on them).
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from libs.hardware.model import FabricState, GpuInfo

NON_FABRIC_CLIQUE = ""


class CliqueStatus(enum.Enum):
    FABRIC = "Fabric"
    """All GPUs completed fabric registration and agree: ``clique_id`` is set."""
    NON_FABRIC = "NonFabric"
    """No MNNVL on this node: the node can join domains as a plain node set (index -1)."""
    PENDING = "Pending"
    """Some GPU is still joining the fabric; ask again later."""
    ERROR = "Error"
    """The GPUs' fabric information is unusable (they disagree, or registration failed)."""


@dataclass(frozen=True, slots=True)
class CliqueResult:
    status: CliqueStatus
    clique_id: str
    """``<clusterUUID>.<cliqueId>`` for FABRIC, "" otherwise."""
    reason: str
    """Why this result, in words fit for a status condition or a log line."""

    @property
    def settled(self) -> bool:
        """False while the fabric is still coming up (the answer may still change by itself)."""
        return self.status is not CliqueStatus.PENDING

    @property
    def usable(self) -> bool:
        """True when the node can take part in domains (with or without MNNVL)."""
        return self.status in (CliqueStatus.FABRIC, CliqueStatus.NON_FABRIC)


def format_clique_id(cluster_uuid: str, clique_id: int) -> str:
    return f"{cluster_uuid}.{clique_id}"


def parse_clique_id(value: str) -> tuple[str, int]:
    """Split ``<clusterUUID>.<cliqueId>``; raises ValueError on anything else (including "")."""
    cluster, sep, clique = value.rpartition(".")
    if not sep or not clique.isdigit():
        raise ValueError(f"not a clique id (want <clusterUUID>.<cliqueId>): {value!r}")
    return str(uuid.UUID(cluster)), int(clique)


def _gpu_clique(gpu: GpuInfo) -> str:
    fabric = gpu.fabric
    if fabric.state is FabricState.NOT_SUPPORTED or fabric.has_zero_cluster_uuid:
        return NON_FABRIC_CLIQUE
    return format_clique_id(fabric.cluster_uuid, fabric.clique_id)


def _describe(value: str) -> str:
    return repr(value) if value else "'' (non-fabric)"


def derive_clique_id(gpus: Sequence[GpuInfo]) -> CliqueResult:
    """The node's clique from all of its GPUs.

    Order of judgement: any GPU in NOT_STARTED / IN_PROGRESS -> PENDING (wait, then judge the
    settled picture); a COMPLETED GPU whose registration status is an error -> ERROR; each GPU's
    own clique ("" for NOT_SUPPORTED or an all-zero cluster UUID) must be the same on all GPUs,
    else ERROR naming two disagreeing values; "" -> NON_FABRIC, otherwise FABRIC.
    """
    if not gpus:
        return CliqueResult(CliqueStatus.NON_FABRIC, NON_FABRIC_CLIQUE, "node has no GPUs")

    pending = [g for g in gpus if g.fabric.state in (FabricState.NOT_STARTED, FabricState.IN_PROGRESS)]
    if pending:
        detail = ", ".join(f"{g.uuid} (GPU {g.index}) is {g.fabric.state.name}" for g in pending)
        return CliqueResult(CliqueStatus.PENDING, NON_FABRIC_CLIQUE, f"fabric not ready: {detail}")

    failed = [g for g in gpus if g.fabric.state is FabricState.COMPLETED and g.fabric.status != 0]
    if failed:
        detail = ", ".join(f"{g.uuid} (GPU {g.index}) status {g.fabric.status}" for g in failed)
        return CliqueResult(CliqueStatus.ERROR, NON_FABRIC_CLIQUE, f"fabric registration failed: {detail}")

    first = gpus[0]
    first_clique = _gpu_clique(first)
    for gpu in gpus[1:]:
        clique = _gpu_clique(gpu)
        if clique != first_clique:
            return CliqueResult(
                CliqueStatus.ERROR,
                NON_FABRIC_CLIQUE,
                f"GPUs disagree on the clique id: {first.uuid} (GPU {first.index}) has "
                f"{_describe(first_clique)}, {gpu.uuid} (GPU {gpu.index}) has {_describe(clique)}",
            )

    if first_clique == NON_FABRIC_CLIQUE:
        why = (
            "fabric state NOT_SUPPORTED"
            if first.fabric.state is FabricState.NOT_SUPPORTED
            else "all-zero cluster UUID"
        )
        return CliqueResult(CliqueStatus.NON_FABRIC, NON_FABRIC_CLIQUE, f"no NVLink fabric: {why}")
    return CliqueResult(CliqueStatus.FABRIC, first_clique, f"all {len(gpus)} GPUs in clique {first_clique}")
