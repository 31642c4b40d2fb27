"""Clique id derivation from GPU fabric infos (spec §3: clique id rules)."""

from __future__ import annotations

import random
import uuid

from hypothesis import given
from hypothesis import strategies as st

from libs.hardware.clique import CliqueStatus, derive_clique_id, format_clique_id, parse_clique_id
from libs.hardware.model import ZERO_CLUSTER_UUID, FabricInfo, FabricState, GpuHealth, GpuInfo

CLUSTER_A = "7c9e6679-7425-40de-944b-e07fc1f90ae7"
CLUSTER_B = "0b1d7a52-3f4e-4c2a-9e55-6f1f0b7b9d10"
PENDING_STATES = (FabricState.NOT_STARTED, FabricState.IN_PROGRESS)


def gpu(
    index: int, state: FabricState, cluster: str = CLUSTER_A, clique: int = 7, status: int = 0
) -> GpuInfo:
    return GpuInfo(
        uuid=f"GPU-{index:08d}-0000-0000-0000-000000000000",
        index=index,
        memory_bytes=1 << 30,
        fabric=FabricInfo(cluster_uuid=cluster, clique_id=clique, state=state, status=status),
    )


fabric_infos = st.builds(
    FabricInfo,
    cluster_uuid=st.sampled_from([CLUSTER_A, CLUSTER_B, ZERO_CLUSTER_UUID]),
    clique_id=st.sampled_from([0, 1, 7, 32766, 2**32 - 1]),
    state=st.sampled_from(list(FabricState)),
    status=st.sampled_from([0, 0, 0, 15]),
    health=st.sampled_from(list(GpuHealth)),
)


@st.composite
def gpu_lists(draw: st.DrawFn, fabric: st.SearchStrategy[FabricInfo] = fabric_infos) -> list[GpuInfo]:
    infos = draw(st.lists(fabric, max_size=8))
    return [GpuInfo(f"GPU-{i}", i, 1 << 30, info) for i, info in enumerate(infos)]


def own_clique(info: FabricInfo) -> str:
    if info.state is FabricState.NOT_SUPPORTED or info.cluster_uuid == ZERO_CLUSTER_UUID:
        return ""
    return f"{info.cluster_uuid}.{info.clique_id}"


@given(gpu_lists())
def test_result_follows_the_clique_rules_and_never_raises(gpus: list[GpuInfo]) -> None:
    result = derive_clique_id(gpus)
    states = {g.fabric.state for g in gpus}
    if states & set(PENDING_STATES):
        assert result.status is CliqueStatus.PENDING
        assert not result.settled
        assert result.clique_id == ""
        return
    assert result.settled
    failed = any(g.fabric.state is FabricState.COMPLETED and g.fabric.status != 0 for g in gpus)
    values = {own_clique(g.fabric) for g in gpus}
    if failed or len(values) > 1:
        assert result.status is CliqueStatus.ERROR
        assert result.clique_id == ""
        assert not result.usable
    elif values in (set(), {""}):
        assert result.status is CliqueStatus.NON_FABRIC
        assert result.clique_id == ""
        assert result.usable
    else:
        assert result.status is CliqueStatus.FABRIC
        assert {result.clique_id} == values
        assert result.usable


@given(gpu_lists(), st.randoms(use_true_random=False))
def test_gpu_order_does_not_change_the_outcome(gpus: list[GpuInfo], rnd: random.Random) -> None:
    shuffled = list(gpus)
    rnd.shuffle(shuffled)
    a, b = derive_clique_id(gpus), derive_clique_id(shuffled)
    assert (a.status, a.clique_id) == (b.status, b.clique_id)


@given(
    st.integers(min_value=1, max_value=8),
    st.uuids(version=4).map(str),
    st.integers(min_value=0, max_value=2**32 - 1),
    st.sampled_from(list(GpuHealth)),
)
def test_agreeing_completed_gpus_give_cluster_dot_clique(
    count: int, cluster: str, clique: int, health: GpuHealth
) -> None:
    gpus = [
        GpuInfo(f"GPU-{i}", i, 1, FabricInfo(cluster, clique, FabricState.COMPLETED, health=health))
        for i in range(count)
    ]
    result = derive_clique_id(gpus)
    assert result.status is CliqueStatus.FABRIC
    assert result.clique_id == f"{cluster}.{clique}"
    assert parse_clique_id(result.clique_id) == (cluster, clique)


@given(gpu_lists(), st.sampled_from(PENDING_STATES), st.integers(min_value=0, max_value=8))
def test_any_transitional_gpu_makes_the_node_wait(
    gpus: list[GpuInfo], state: FabricState, position: int
) -> None:
    """Upstream #1264 crashed on these states; here they are a result to wait on."""
    position = min(position, len(gpus))
    gpus.insert(position, gpu(99, state))
    result = derive_clique_id(gpus)
    assert result.status is CliqueStatus.PENDING
    assert "GPU 99" in result.reason and state.name in result.reason


def test_not_supported_is_a_non_fabric_node() -> None:
    result = derive_clique_id([gpu(i, FabricState.NOT_SUPPORTED, ZERO_CLUSTER_UUID, 0) for i in range(4)])
    assert (result.status, result.clique_id) == (CliqueStatus.NON_FABRIC, "")
    assert "NOT_SUPPORTED" in result.reason


def test_completed_with_all_zero_cluster_uuid_is_a_non_fabric_node() -> None:
    result = derive_clique_id([gpu(i, FabricState.COMPLETED, ZERO_CLUSTER_UUID, 5) for i in range(4)])
    assert (result.status, result.clique_id) == (CliqueStatus.NON_FABRIC, "")
    assert "all-zero" in result.reason


def test_node_without_gpus_is_non_fabric() -> None:
    assert derive_clique_id([]).status is CliqueStatus.NON_FABRIC


def test_disagreeing_gpus_are_an_error_naming_both_values() -> None:
    gpus = [
        gpu(0, FabricState.COMPLETED),
        gpu(1, FabricState.COMPLETED),
        gpu(2, FabricState.COMPLETED, CLUSTER_B, 9),
    ]
    result = derive_clique_id(gpus)
    assert result.status is CliqueStatus.ERROR
    assert f"{CLUSTER_A}.7" in result.reason and f"{CLUSTER_B}.9" in result.reason
    assert gpus[2].uuid in result.reason


def test_fabric_gpu_next_to_non_fabric_gpu_is_an_error() -> None:
    gpus = [gpu(0, FabricState.COMPLETED), gpu(1, FabricState.NOT_SUPPORTED, ZERO_CLUSTER_UUID, 0)]
    result = derive_clique_id(gpus)
    assert result.status is CliqueStatus.ERROR
    assert f"{CLUSTER_A}.7" in result.reason and "non-fabric" in result.reason


def test_failed_fabric_registration_is_an_error_with_the_status() -> None:
    result = derive_clique_id([gpu(0, FabricState.COMPLETED), gpu(1, FabricState.COMPLETED, status=15)])
    assert result.status is CliqueStatus.ERROR
    assert "status 15" in result.reason and "GPU 1" in result.reason


@given(st.uuids().map(str), st.integers(min_value=0, max_value=2**32 - 1))
def test_clique_id_string_round_trips(cluster: str, clique: int) -> None:
    assert parse_clique_id(format_clique_id(cluster, clique)) == (cluster, clique)


def test_parse_clique_id_rejects_non_clique_strings() -> None:
    for bad in ("", "abc", f"{CLUSTER_A}", f"{CLUSTER_A}.x", "not-a-uuid.3"):
        try:
            parse_clique_id(bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad!r}")
    assert str(uuid.UUID(CLUSTER_A)) == CLUSTER_A
