"""NVML backend against a fake ``pynvml`` built from the real module's structures and errors.

The fake keeps pynvml's calling convention: fabric-info calls receive ``byref(<struct>)`` of the
real ``c_nvmlGpuFabricInfoV_t`` / ``c_nvmlGpuFabricInfo_t`` and fill it in, errors are the real
``NVMLError`` subclasses. So a wrong field name, a missing struct version or a wrong call shape in
the backend fails here as it would on a GB200 node.
"""

from __future__ import annotations

import ctypes
import types
import uuid
from dataclasses import dataclass, field
from typing import Any

import pynvml
import pytest

from libs.hardware.clique import CliqueStatus
from libs.hardware.errors import NvmlError
from libs.hardware.interface import NodeHardware
from libs.hardware.model import ZERO_CLUSTER_UUID, FabricState, GpuHealth
from libs.hardware.nvml import NvmlNodeHardware, health_from_fabric_health_mask

CLUSTER = uuid.UUID("2a3b4c5d-6e7f-4a1b-8c2d-3e4f5a6b7c8d")
OTHER_CLUSTER = uuid.UUID("9f8e7d6c-5b4a-4392-8170-6f5e4d3c2b1a")
HBM = 189_471 * 2**20


@dataclass
class FakeGpu:
    state: int = pynvml.NVML_GPU_FABRIC_STATE_COMPLETED
    cluster: bytes = CLUSTER.bytes
    clique: int = 32766
    status: int = pynvml.NVML_SUCCESS
    health_mask: int = 0
    v_error: int | None = None  # NVML return code of nvmlDeviceGetGpuFabricInfoV
    v1_error: int | None = None  # ... of nvmlDeviceGetGpuFabricInfo


@dataclass
class FakeNvml:
    gpus: list[FakeGpu]
    driver: str = "570.133.20"
    init_error: int | None = None
    uuid_as_bytes: bool = False
    calls: list[str] = field(default_factory=list)

    def module(self, with_v: bool = True) -> types.SimpleNamespace:
        """What ``import pynvml`` gives the backend (the V symbols only when ``with_v``)."""
        attrs: dict[str, object] = {
            "NVMLError": pynvml.NVMLError,
            "c_nvmlGpuFabricInfo_t": pynvml.c_nvmlGpuFabricInfo_t,
            "nvmlInit": self.nvmlInit,
            "nvmlShutdown": lambda: self.calls.append("shutdown"),
            "nvmlSystemGetDriverVersion": lambda: self.driver,
            "nvmlDeviceGetCount": lambda: len(self.gpus),
            "nvmlDeviceGetHandleByIndex": self.handle,
            "nvmlDeviceGetUUID": self.uuid,
            "nvmlDeviceGetIndex": lambda h: h,
            "nvmlDeviceGetMemoryInfo": self.memory,
            "nvmlDeviceGetGpuFabricInfo": self.fabric_v1,
        }
        if with_v:
            attrs["c_nvmlGpuFabricInfoV_t"] = pynvml.c_nvmlGpuFabricInfoV_t
            attrs["nvmlDeviceGetGpuFabricInfoV"] = self.fabric_v
        return types.SimpleNamespace(**attrs)

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)

    def handle(self, index: int) -> int:
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return index

    def uuid(self, handle: int) -> str | bytes:
        value = f"GPU-{uuid.UUID(int=handle + 1)}"
        return value.encode() if self.uuid_as_bytes else value

    def memory(self, handle: int) -> pynvml.c_nvmlMemory_t:
        mem = pynvml.c_nvmlMemory_t()
        mem.total, mem.free, mem.used = HBM, HBM - 5, 5
        return mem

    @staticmethod
    def _target(ref: object, wanted: type[ctypes.Structure]) -> Any:
        obj = getattr(ref, "_obj", None)  # ctypes.byref(...) keeps the struct in _obj
        assert isinstance(obj, wanted), f"expected byref({wanted.__name__}), got {ref!r}"
        return obj

    def _fill(self, info: Any, gpu: FakeGpu) -> None:
        ctypes.memmove(info.clusterUuid, gpu.cluster, 16)
        info.status, info.cliqueId, info.state = gpu.status, gpu.clique, gpu.state

    def fabric_v(self, handle: int, ref: object) -> int:
        self.calls.append("fabricV")
        info = self._target(ref, pynvml.c_nvmlGpuFabricInfoV_t)
        assert info.version == pynvml.nvmlGpuFabricInfo_v2, "struct version not set"
        gpu = self.gpus[handle]
        if gpu.v_error is not None:
            raise pynvml.NVMLError(gpu.v_error)
        self._fill(info, gpu)
        info.healthMask = gpu.health_mask
        return pynvml.NVML_SUCCESS

    def fabric_v1(self, handle: int, ref: object) -> int:
        self.calls.append("fabric")
        info = self._target(ref, pynvml.c_nvmlGpuFabricInfo_t)
        gpu = self.gpus[handle]
        if gpu.v1_error is not None:
            raise pynvml.NVMLError(gpu.v1_error)
        self._fill(info, gpu)
        return pynvml.NVML_SUCCESS


def backend(fake: FakeNvml, with_v: bool = True) -> NvmlNodeHardware:
    return NvmlNodeHardware(nvml=fake.module(with_v=with_v))


def test_completed_fabric_gives_the_clique_and_gpu_inventory() -> None:
    fake = FakeNvml([FakeGpu() for _ in range(4)])
    hw = backend(fake)
    assert isinstance(hw, NodeHardware) and hw.imex_backend == "nvidia"
    gpus = hw.gpus()
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    assert gpus[2].uuid == f"GPU-{uuid.UUID(int=3)}"
    assert all(g.memory_bytes == HBM for g in gpus)
    assert all(g.fabric.cluster_uuid == str(CLUSTER) and g.fabric.clique_id == 32766 for g in gpus)
    result = hw.clique()
    assert (result.status, result.clique_id) == (CliqueStatus.FABRIC, f"{CLUSTER}.32766")
    assert "fabric" not in fake.calls  # the V call sufficed
    assert hw.driver_version() == "570.133.20"


def test_in_progress_gpu_makes_the_node_wait_without_error() -> None:
    fake = FakeNvml([FakeGpu(), FakeGpu(state=pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS, cluster=bytes(16))])
    result = backend(fake).clique()
    assert result.status is CliqueStatus.PENDING
    assert "IN_PROGRESS" in result.reason


def test_not_started_gpu_makes_the_node_wait() -> None:
    fake = FakeNvml([FakeGpu(state=pynvml.NVML_GPU_FABRIC_STATE_NOT_STARTED, cluster=bytes(16))] * 4)
    assert backend(fake).clique().status is CliqueStatus.PENDING


def test_not_supported_state_is_a_non_fabric_node() -> None:
    fake = FakeNvml(
        [FakeGpu(state=pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED, cluster=bytes(16), clique=0)] * 2
    )
    result = backend(fake).clique()
    assert (result.status, result.clique_id) == (CliqueStatus.NON_FABRIC, "")


def test_gpu_without_fabric_support_in_either_call_is_non_fabric() -> None:
    """Pre-Hopper GPUs answer NOT_SUPPORTED to both fabric calls."""
    code = pynvml.NVML_ERROR_NOT_SUPPORTED
    fake = FakeNvml([FakeGpu(v_error=code, v1_error=code)] * 2)
    hw = backend(fake)
    gpus = hw.gpus()
    assert all(g.fabric.state is FabricState.NOT_SUPPORTED for g in gpus)
    assert all(g.fabric.cluster_uuid == ZERO_CLUSTER_UUID for g in gpus)
    assert fake.calls.count("fabric") == 2  # fell back, per GPU
    assert hw.clique().status is CliqueStatus.NON_FABRIC


def test_all_zero_cluster_uuid_is_a_non_fabric_node() -> None:
    fake = FakeNvml([FakeGpu(cluster=bytes(16), clique=0)] * 4)
    result = backend(fake).clique()
    assert (result.status, result.clique_id) == (CliqueStatus.NON_FABRIC, "")
    assert "all-zero" in result.reason


def test_disagreeing_gpus_report_both_clique_values() -> None:
    fake = FakeNvml([FakeGpu(), FakeGpu(), FakeGpu(cluster=OTHER_CLUSTER.bytes, clique=5)])
    result = backend(fake).clique()
    assert result.status is CliqueStatus.ERROR
    assert f"{CLUSTER}.32766" in result.reason and f"{OTHER_CLUSTER}.5" in result.reason


def test_failed_fabric_registration_status_is_an_error() -> None:
    fake = FakeNvml([FakeGpu(), FakeGpu(status=pynvml.NVML_ERROR_TIMEOUT)])
    result = backend(fake).clique()
    assert result.status is CliqueStatus.ERROR
    assert f"status {pynvml.NVML_ERROR_TIMEOUT}" in result.reason


def test_old_pynvml_without_v_uses_the_old_call() -> None:
    fake = FakeNvml([FakeGpu(health_mask=1)] * 4)
    hw = backend(fake, with_v=False)
    result = hw.clique()
    assert (result.status, result.clique_id) == (CliqueStatus.FABRIC, f"{CLUSTER}.32766")
    assert fake.calls.count("fabric") == 4 and "fabricV" not in fake.calls
    assert all(g.health is GpuHealth.HEALTHY for g in hw.gpus())  # no health mask in the old struct


@pytest.mark.parametrize(
    "code",
    [
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
    ],
)
def test_v_call_unavailable_in_the_driver_falls_back(code: int) -> None:
    fake = FakeNvml([FakeGpu(v_error=code)] * 2)
    result = backend(fake).clique()
    assert (result.status, result.clique_id) == (CliqueStatus.FABRIC, f"{CLUSTER}.32766")
    assert fake.calls.count("fabricV") == 2 and fake.calls.count("fabric") == 2


def test_other_nvml_errors_surface_with_nvml_text() -> None:
    fake = FakeNvml([FakeGpu(), FakeGpu(v_error=pynvml.NVML_ERROR_GPU_IS_LOST)])
    with pytest.raises(NvmlError) as info:
        backend(fake).gpus()
    assert info.value.code == pynvml.NVML_ERROR_GPU_IS_LOST
    assert "GPU is lost" in str(info.value) and "nvmlDeviceGetGpuFabricInfoV" in str(info.value)
    assert f"GPU-{uuid.UUID(int=2)}" in str(info.value)


def test_init_failure_is_wrapped() -> None:
    fake = FakeNvml([], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    with pytest.raises(NvmlError, match="nvmlInit failed: Driver Not Loaded"):
        backend(fake)


def test_real_pynvml_without_a_driver_fails_cleanly() -> None:
    """This machine has no NVIDIA driver: the real module's error comes out as ours."""
    try:
        hw = NvmlNodeHardware()
    except NvmlError as exc:
        assert exc.code in (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    else:  # pragma: no cover - only on a GPU host
        hw.close()
        pytest.skip("an NVIDIA driver is present")


def test_bytes_uuids_from_old_pynvml_are_decoded() -> None:
    fake = FakeNvml([FakeGpu()], uuid_as_bytes=True)
    assert backend(fake).gpus()[0].uuid == f"GPU-{uuid.UUID(int=1)}"


def test_close_shuts_nvml_down_once() -> None:
    fake = FakeNvml([FakeGpu()])
    hw = backend(fake)
    hw.close()
    hw.close()
    assert fake.calls.count("shutdown") == 1


def _mask(shift: int, value: int) -> int:
    return value << shift


@pytest.mark.parametrize(
    ("mask", "health"),
    [
        (0, GpuHealth.HEALTHY),
        (
            _mask(
                pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW,
                pynvml.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_FALSE,
            )
            | _mask(
                pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_INCORRECT_CONFIGURATION,
                pynvml.NVML_GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_NONE,
            )
            | _mask(
                pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_GFM_STATE,
                pynvml.NVML_GPU_FABRIC_HEALTH_MASK_GFM_STATE_CONNECTED,
            ),
            GpuHealth.HEALTHY,
        ),
        (
            _mask(
                pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW,
                pynvml.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE,
            ),
            GpuHealth.DEGRADED,
        ),
        (
            _mask(
                pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_RECOVERY,
                pynvml.NVML_GPU_FABRIC_HEALTH_MASK_ROUTE_RECOVERY_TRUE,
            ),
            GpuHealth.DEGRADED,
        ),
        (
            _mask(
                pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ACCESS_TIMEOUT_RECOVERY,
                pynvml.NVML_GPU_FABRIC_HEALTH_MASK_ACCESS_TIMEOUT_RECOVERY_TRUE,
            ),
            GpuHealth.DEGRADED,
        ),
        (
            _mask(
                pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_GFM_STATE,
                pynvml.NVML_GPU_FABRIC_HEALTH_MASK_GFM_STATE_DISCONNECTED,
            ),
            GpuHealth.DEGRADED,
        ),
        (
            _mask(
                pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_UNHEALTHY,
                pynvml.NVML_GPU_FABRIC_HEALTH_MASK_ROUTE_UNHEALTHY_TRUE,
            )
            | _mask(
                pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW,
                pynvml.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE,
            ),
            GpuHealth.UNHEALTHY,
        ),
        (
            _mask(
                pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_INCORRECT_CONFIGURATION,
                pynvml.NVML_GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_NO_PARTITION,
            ),
            GpuHealth.UNHEALTHY,
        ),
    ],
)
def test_fabric_health_mask_decodes_with_nvml_layout(mask: int, health: GpuHealth) -> None:
    assert health_from_fabric_health_mask(mask) is health
    fake = FakeNvml([FakeGpu(health_mask=mask)])
    assert backend(fake).snapshot().health is health
