"""Pick and open a hardware backend from command-line style settings."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, get_args

from libs.hardware.imex_channels import DEFAULT_PROC_DEVICES
from libs.hardware.interface import NodeHardware

HardwareKind = Literal["nvml", "simulated"]
HARDWARE_KINDS: tuple[str, ...] = get_args(HardwareKind)


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
        from libs.hardware.simulated import SimulatedNodeHardware

        return SimulatedNodeHardware.from_cluster_file(sim_cluster, node, sim_state_base)
    raise ValueError(f"unknown hardware backend {kind!r} (one of {', '.join(HARDWARE_KINDS)})")
