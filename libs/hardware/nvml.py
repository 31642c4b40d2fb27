"""Real hardware through NVML (nvidia-ml-py's ``pynvml``).

The ``pynvml`` module is a constructor argument (default: the real one, imported lazily) so that
tests can substitute a fake at the import boundary; nothing here needs a GPU to import.
"""

from __future__ import annotations

import ctypes
import importlib
import uuid
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any, TypeVar

import structlog

from libs.hardware.clique import CliqueResult
from libs.hardware.errors import HardwareError, NvmlError
from libs.hardware.health import poll_health_events
from libs.hardware.imex_channels import (
    DEFAULT_PROC_DEVICES,
    create_imex_channel_node,
    imex_channel_host_path,
    read_imex_channel_major,
)
from libs.hardware.interface import HardwareSnapshot, HealthEvent, ImexBackendName
from libs.hardware.model import ZERO_CLUSTER_UUID, FabricInfo, FabricState, GpuHealth, GpuInfo
from libs.hardware.off_loop import OffLoopCalls

log = structlog.get_logger(__name__)

DEFAULT_NVML_POLL_INTERVAL = 5.0

# Layout of nvmlGpuFabricInfo healthMask (NVML_GPU_FABRIC_HEALTH_MASK_*): (shift, width) per field.
# Fixed by the driver ABI, so spelled out here rather than read from whatever pynvml is loaded.
_DEGRADED_BW = (0, 0x3)
_ROUTE_RECOVERY = (2, 0x3)
_ROUTE_UNHEALTHY = (4, 0x3)
_ACCESS_TIMEOUT_RECOVERY = (6, 0x3)
_INCORRECT_CONFIGURATION = (8, 0xF)
_GFM_STATE = (14, 0x3)
_FLAG_TRUE = 1
_CONFIG_NOT_SUPPORTED, _CONFIG_NONE = 0, 1
_GFM_DISCONNECTED = 2

# Return codes (nvmlReturn_t) after which the old fabric-info call is tried instead of the V one.
_NVML_ERROR_NOT_SUPPORTED = 3
_NVML_ERROR_FUNCTION_NOT_FOUND = 13
_NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
_FALLBACK_CODES = frozenset(
    {_NVML_ERROR_NOT_SUPPORTED, _NVML_ERROR_FUNCTION_NOT_FOUND, _NVML_ERROR_ARGUMENT_VERSION_MISMATCH}
)
_NO_FABRIC_CODES = frozenset({_NVML_ERROR_NOT_SUPPORTED, _NVML_ERROR_FUNCTION_NOT_FOUND})

_T = TypeVar("_T")


def _field(mask: int, layout: tuple[int, int]) -> int:
    shift, width = layout
    return (mask >> shift) & width


def health_from_fabric_health_mask(mask: int) -> GpuHealth:
    """Reduce NVML's fabric ``healthMask`` to one health level.

    UNHEALTHY: routes unhealthy or an incorrect configuration (wrong SysGUID, chassis, no
    partition, too few NVLinks, ...). DEGRADED: reduced bandwidth, a recovery in progress, or the
    global fabric manager disconnected (the fabric keeps working but cannot change).
    """
    config = _field(mask, _INCORRECT_CONFIGURATION)
    if _field(mask, _ROUTE_UNHEALTHY) == _FLAG_TRUE or config not in (_CONFIG_NOT_SUPPORTED, _CONFIG_NONE):
        return GpuHealth.UNHEALTHY
    if (
        _field(mask, _DEGRADED_BW) == _FLAG_TRUE
        or _field(mask, _ROUTE_RECOVERY) == _FLAG_TRUE
        or _field(mask, _ACCESS_TIMEOUT_RECOVERY) == _FLAG_TRUE
        or _field(mask, _GFM_STATE) == _GFM_DISCONNECTED
    ):
        return GpuHealth.DEGRADED
    return GpuHealth.HEALTHY


def _text(value: str | bytes) -> str:
    # pynvml returns str since it decodes (convertStrBytes); older releases returned bytes.
    return value.decode() if isinstance(value, bytes) else value


def _decode_fabric(info: Any, health: GpuHealth, gpu: str) -> FabricInfo:
    try:
        state = FabricState(int(info.state))
    except ValueError:
        raise HardwareError(f"{gpu}: NVML reports unknown GPU fabric state {int(info.state)}") from None
    return FabricInfo(
        cluster_uuid=str(uuid.UUID(bytes=bytes(info.clusterUuid))),
        clique_id=int(info.cliqueId),
        state=state,
        status=int(info.status),
        health=health,
    )


class NvmlNodeHardware:
    """:class:`~libs.hardware.interface.NodeHardware` on a real GPU node."""

    imex_backend: ImexBackendName = "nvidia"

    def __init__(
        self,
        *,
        nvml: Any = None,
        proc_devices: Path = DEFAULT_PROC_DEVICES,
        dev_root: Path = Path("/"),
        poll_interval: float = DEFAULT_NVML_POLL_INTERVAL,
    ) -> None:
        self._nvml = nvml if nvml is not None else importlib.import_module("pynvml")
        self.proc_devices = proc_devices
        self.dev_root = dev_root
        self.poll_interval = poll_interval
        self._call("nvmlInit", self._nvml.nvmlInit)
        self._initialized = True

    def _call(self, operation: str, fn: Callable[..., _T], *args: Any) -> _T:
        try:
            return fn(*args)
        except self._nvml.NVMLError as exc:
            raise NvmlError(operation, getattr(exc, "value", None), str(exc)) from exc

    def _fabric_info(self, handle: Any, gpu: str) -> FabricInfo:
        nvml = self._nvml
        get_v = getattr(nvml, "nvmlDeviceGetGpuFabricInfoV", None)
        struct_v = getattr(nvml, "c_nvmlGpuFabricInfoV_t", None)
        if get_v is not None and struct_v is not None:
            info_v = struct_v()  # its constructor sets the struct version (nvmlGpuFabricInfo_v2)
            try:
                get_v(handle, ctypes.byref(info_v))
            except nvml.NVMLError as exc:
                if getattr(exc, "value", None) not in _FALLBACK_CODES:
                    raise NvmlError("nvmlDeviceGetGpuFabricInfoV", exc.value, f"{gpu}: {exc}") from exc
                log.debug("falling back to nvmlDeviceGetGpuFabricInfo", gpu=gpu, error=str(exc))
            else:
                return _decode_fabric(info_v, health_from_fabric_health_mask(int(info_v.healthMask)), gpu)

        get_v1 = getattr(nvml, "nvmlDeviceGetGpuFabricInfo", None)
        if get_v1 is None:
            return FabricInfo(ZERO_CLUSTER_UUID, 0, FabricState.NOT_SUPPORTED)
        info = nvml.c_nvmlGpuFabricInfo_t()
        try:
            get_v1(handle, ctypes.byref(info))
        except nvml.NVMLError as exc:
            if getattr(exc, "value", None) in _NO_FABRIC_CODES:
                return FabricInfo(ZERO_CLUSTER_UUID, 0, FabricState.NOT_SUPPORTED)
            raise NvmlError("nvmlDeviceGetGpuFabricInfo", exc.value, f"{gpu}: {exc}") from exc
        # The old structure has no health mask: report healthy rather than guess.
        return _decode_fabric(info, GpuHealth.HEALTHY, gpu)

    def gpus(self) -> tuple[GpuInfo, ...]:
        nvml = self._nvml
        count = self._call("nvmlDeviceGetCount", nvml.nvmlDeviceGetCount)
        result = []
        for position in range(count):
            handle = self._call("nvmlDeviceGetHandleByIndex", nvml.nvmlDeviceGetHandleByIndex, position)
            gpu_uuid = _text(self._call("nvmlDeviceGetUUID", nvml.nvmlDeviceGetUUID, handle))
            index = self._call("nvmlDeviceGetIndex", nvml.nvmlDeviceGetIndex, handle)
            memory = self._call("nvmlDeviceGetMemoryInfo", nvml.nvmlDeviceGetMemoryInfo, handle)
            result.append(
                GpuInfo(
                    uuid=gpu_uuid,
                    index=int(index),
                    memory_bytes=int(memory.total),
                    fabric=self._fabric_info(handle, gpu_uuid),
                )
            )
        return tuple(sorted(result, key=lambda g: g.index))

    def snapshot(self) -> HardwareSnapshot:
        return HardwareSnapshot.of(self.gpus())

    def clique(self) -> CliqueResult:
        return self.snapshot().clique

    def driver_version(self) -> str:
        return _text(self._call("nvmlSystemGetDriverVersion", self._nvml.nvmlSystemGetDriverVersion))

    def imex_channel_major(self) -> int:
        return read_imex_channel_major(self.proc_devices)

    def imex_channel_path(self, channel: int) -> Path:
        return imex_channel_host_path(self.dev_root, channel)

    def ensure_imex_channel_device(self, channel: int) -> Path:
        try:
            return create_imex_channel_node(self.dev_root, channel, self.imex_channel_major())
        except OSError as exc:
            raise HardwareError(f"cannot create IMEX channel {channel}: {exc}") from exc

    def health_events(
        self,
        since: HardwareSnapshot | None = None,
        interval: float | None = None,
        calls: OffLoopCalls | None = None,
    ) -> AsyncGenerator[HealthEvent, None]:
        return poll_health_events(self.snapshot, interval or self.poll_interval, since, calls)

    def close(self) -> None:
        if self._initialized:
            self._initialized = False
            self._call("nvmlShutdown", self._nvml.nvmlShutdown)
