"""Pick and open a hardware backend from command-line style settings."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Literal, Protocol, cast, get_args

from libs.hardware.imex_channels import DEFAULT_PROC_DEVICES
from libs.hardware.interface import NodeHardware
from libs.runtime.stand_ins import load_standin

HardwareKind = Literal["nvml", "simulated"]
HARDWARE_KINDS: tuple[str, ...] = get_args(HardwareKind)

# The simulated backend is part of the rig (tools/sim), which the product does not import: it is
# named here and loaded only when a program is told --hardware simulated.
SIMULATED_HARDWARE = "tools.sim.hardware.simulated:SimulatedNodeHardware.from_cluster_file"
OpenSimulated = Callable[[Path, str, Path | None], NodeHardware]


def open_node_hardware(
    kind: str,
    *,
    sim_cluster: Path | None = None,
    node: str | None = None,
    sim_state_base: Path | None = None,
    proc_devices: Path | None = None,
    dev_root: Path | None = None,
) -> NodeHardware:
    """``--hardware nvml`` (real GPUs) or ``--hardware simulated --sim-cluster F --node N``.

    Simulated state directories default to ``nodes/<node>`` next to the cluster file.
    """
    if kind == "nvml":
        from libs.hardware.nvml import NvmlNodeHardware

        return NvmlNodeHardware(
            proc_devices=proc_devices or DEFAULT_PROC_DEVICES, dev_root=dev_root or Path("/")
        )
    if kind == "simulated":
        if sim_cluster is None or not node:
            raise ValueError("simulated hardware needs a cluster description file and a node name")
        open_simulated = cast(OpenSimulated, load_standin(SIMULATED_HARDWARE))
        return open_simulated(sim_cluster, node, sim_state_base)
    raise ValueError(f"unknown hardware backend {kind!r} (one of {', '.join(HARDWARE_KINDS)})")


class NodeHardwareSettings(Protocol):
    """The hardware settings both node programs take (``--hardware``, ``--sim-cluster``, ...)."""

    @property
    def hardware(self) -> str: ...
    @property
    def sim_cluster(self) -> str: ...
    @property
    def node_name(self) -> str: ...
    @property
    def sim_state_dir(self) -> str: ...
    @property
    def proc_devices(self) -> str: ...
    @property
    def driver_root(self) -> str: ...


def open_node_hardware_from(settings: NodeHardwareSettings) -> NodeHardware:
    """`open_node_hardware` for a node program's settings (empty paths: not given)."""
    return open_node_hardware(
        settings.hardware,
        sim_cluster=Path(settings.sim_cluster) if settings.sim_cluster else None,
        node=settings.node_name,
        sim_state_base=Path(settings.sim_state_dir) if settings.sim_state_dir else None,
        proc_devices=Path(settings.proc_devices),
        dev_root=Path(settings.driver_root),
    )
