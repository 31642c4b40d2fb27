"""Hardware abstraction: GPUs, NVLink fabric and clique, IMEX channel devices, health.

Import the port and its data from here; a backend through ``libs.hardware.factory``: real NVML
(``libs.hardware.nvml``) or the simulated hardware of the rig (``tools/sim/hardware``), which the
factory loads by name.
"""

from libs.hardware.clique import (
    NON_FABRIC_CLIQUE,
    CliqueResult,
    CliqueStatus,
    derive_clique_id,
    format_clique_id,
    parse_clique_id,
)
from libs.hardware.errors import HardwareError, ImexChannelsUnavailableError, NvmlError, UnknownNodeError
from libs.hardware.imex_channels import (
    IMEX_CHANNEL_COUNT,
    imex_channel_container_path,
    imex_channel_host_path,
    parse_imex_channel_major,
    read_imex_channel_major,
)
from libs.hardware.interface import HardwareSnapshot, HealthEvent, ImexBackendName, NodeHardware
from libs.hardware.model import ZERO_CLUSTER_UUID, FabricInfo, FabricState, GpuHealth, GpuInfo

__all__ = [
    "IMEX_CHANNEL_COUNT",
    "NON_FABRIC_CLIQUE",
    "ZERO_CLUSTER_UUID",
    "CliqueResult",
    "CliqueStatus",
    "FabricInfo",
    "FabricState",
    "GpuHealth",
    "GpuInfo",
    "HardwareError",
    "HardwareSnapshot",
    "HealthEvent",
    "ImexBackendName",
    "ImexChannelsUnavailableError",
    "NodeHardware",
    "NvmlError",
    "UnknownNodeError",
    "derive_clique_id",
    "format_clique_id",
    "imex_channel_container_path",
    "imex_channel_host_path",
    "parse_clique_id",
    "parse_imex_channel_major",
    "read_imex_channel_major",
]
