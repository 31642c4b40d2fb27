"""The gang placement benchmark's trace and figures (tools/bench/gang_trace.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tools.bench.gang_placement import (
    METRIC_MODE,
    MODE_SETTINGS,
    PLUGIN_SCHEDULER,
    compare_with_native,
    job_object,
    pod_group_object,
)
from tools.bench.gang_trace import MAX_GANG, Gang, Tally, fewer_stranded, make_trace, stranded_nodes


def test_a_trace_is_seeded_and_its_gangs_fit_a_clique_and_arrive_in_order() -> None:
    trace = make_trace(7, 40, 4.0, (10.0, 30.0))
    assert trace == make_trace(7, 40, 4.0, (10.0, 30.0))
    assert trace != make_trace(8, 40, 4.0, (10.0, 30.0))
    assert all(1 <= g.size <= MAX_GANG and 10.0 <= g.hold_s <= 30.0 for g in trace)
    assert [g.arrive_s for g in trace] == sorted(g.arrive_s for g in trace)
    assert {g.size for g in trace} >= {1, 16}  # small and rack-sized gangs both occur
    assert max(g.size for g in make_trace(7, 40, 4.0, (10.0, 30.0), largest=6)) <= 6
    with pytest.raises(ValueError, match="largest"):
        make_trace(7, 4, 4.0, (10.0, 30.0), largest=19)


def test_stranded_nodes_are_the_free_ones_no_waiting_gang_fits_beside() -> None:
    # 5 free in one clique, 3 in the other; the smallest waiting gang wants 4: the 3 are stranded.
    assert stranded_nodes({"a": 5, "b": 3}, 4) == 3
    assert stranded_nodes({"a": 5, "b": 3}, 6) == 8
    assert stranded_nodes({"a": 5, "b": 3}, 3) == 0
    assert stranded_nodes({"a": 5, "b": 3}, 0) == 0  # nobody waits


def test_the_tally_integrates_stranded_nodes_only_while_a_gang_waits() -> None:
    tally = Tally()
    tally.sample(0.0, 0.0, {"a": 18, "b": 18}, [])
    tally.sample(2.0, 2.0, {"a": 3, "b": 2}, [4])  # 5 stranded for 2 s
    tally.sample(3.0, 1.0, {"a": 3, "b": 2}, [])  # nobody waits: nothing stranded
    summary = tally.summary()
    assert summary["stranded_node_s"] == 10.0 and summary["waiting_s"] == 2.0
    assert summary["stranded_mean_while_waiting"] == 5.0 and summary["stranded_max"] == 5
    assert summary["largest_free_block_min"] == 3
    assert summary["largest_free_block_mean"] == pytest.approx((3 * 2 + 3 * 1) / 3, abs=0.01)
    # Bound pods of a gang not yet whole hold nodes no waiting gang can use.
    tally.sample(5.0, 2.0, {"a": 0, "b": 0}, [4], partial=6)
    later = tally.summary()
    assert later["partial_node_s"] == 12.0 and later["unusable_node_s"] == 10.0 + 12.0
    assert later["partial_max"] == 6 and later["largest_free_block_min"] == 0
    with pytest.raises(ValueError, match="forward"):
        tally.sample(4.0, -1.0, {"a": 1}, [])


@given(native=st.floats(0.0, 1e6), ours=st.floats(0.0, 1e6), more=st.floats(0.0, 1e6))
def test_fewer_stranded_grows_as_ours_strand_less(native: float, ours: float, more: float) -> None:
    value = fewer_stranded(native, ours)
    assert value <= 1.0
    assert fewer_stranded(native, ours + more) <= value
    if native <= 0:
        assert value == 0.0  # nothing stranded natively: nothing to avoid
    else:
        assert fewer_stranded(native, 0.0) == 1.0 and fewer_stranded(native, native) == 0.0


def test_each_mode_schedules_its_gangs_its_own_way() -> None:
    gang = Gang(3, 0.0, 9, 10.0)
    native = job_object(gang, "ns", MODE_SETTINGS["native"])["spec"]["template"]
    assert native["spec"]["schedulingGroup"] == {"podGroupName": gang.name}
    assert "annotations" not in native["metadata"] and "schedulerName" not in native["spec"]
    group = pod_group_object(gang, "ns")["spec"]
    assert group["schedulingPolicy"]["gang"]["minCount"] == 9
    assert group["schedulingConstraints"]["topology"] == [{"key": "nvidia.com/gpu.clique"}]
    advisor = job_object(gang, "ns", MODE_SETTINGS["advisor"])["spec"]["template"]
    assert "schedulingGroup" not in advisor["spec"] and "schedulerName" not in advisor["spec"]
    assert advisor["metadata"]["annotations"] == {"resource.nvidia.com/computeDomainSize": "9"}
    # cd-scheduler reads the size from the domain's spec.numNodes: no hint.
    plugin = job_object(gang, "ns", MODE_SETTINGS["plugin"])["spec"]["template"]
    assert plugin["spec"]["schedulerName"] == PLUGIN_SCHEDULER
    assert "schedulingGroup" not in plugin["spec"] and "annotations" not in plugin["metadata"]
    both = job_object(gang, "ns", MODE_SETTINGS["plugin-gang"])["spec"]["template"]
    assert both["spec"]["schedulerName"] == PLUGIN_SCHEDULER
    assert both["spec"]["schedulingGroup"] == {"podGroupName": gang.name}
    # The plugin keeps the gang in one clique; the PodGroup only makes it whole.
    assert "schedulingConstraints" not in pod_group_object(gang, "ns", topology=False)["spec"]


def test_every_mode_is_compared_with_native_and_the_metric_is_the_plugins() -> None:
    def figures(stranded: float, partial: float, p50: float) -> dict[str, float]:
        return {"stranded_node_s": stranded, "unusable_node_s": stranded + partial, "bind_p50_s": p50}

    modes = {
        "native": figures(100.0, 0.0, 20.0),
        "advisor": figures(50.0, 150.0, 10.0),
        METRIC_MODE: figures(60.0, 10.0, 30.0),
    }
    out = compare_with_native(modes)
    assert out["stranded_vs_native_advisor"] == 0.5 and out["unusable_vs_native_advisor"] == -1.0
    assert out[f"unusable_vs_native_{METRIC_MODE}"] == 0.3 and out["unusable_vs_native"] == 0.3
    assert out["stranded_vs_native"] == 0.4
    assert out["bind_p50_vs_native_advisor"] == 0.5 and out[f"bind_p50_vs_native_{METRIC_MODE}"] == 1.5
    # Without the metric's mode (or without native) the metric is not made up.
    assert "unusable_vs_native" not in compare_with_native({k: modes[k] for k in ("native", "advisor")})
    assert compare_with_native({"advisor": modes["advisor"]}) == {}
