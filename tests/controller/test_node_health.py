"""The NodesReady condition of a ComputeDomain: Kubernetes' readiness of its member nodes."""

from __future__ import annotations

from typing import Any

from services.controller.kube.node_health import (
    CONDITION_NODES_READY,
    REASON_NODE_NOT_READY,
    NodeReadiness,
    node_events,
    nodes_condition,
    not_ready_nodes,
    with_nodes_condition,
)

T0 = 1_700_000_000_000
UNKNOWN = NodeReadiness("Unknown", "NodeStatusUnknown", "Kubelet stopped posting node status.")


def _node(name: str, ready: str | None) -> dict[str, Any]:
    conditions = [] if ready is None else [{"type": "Ready", "status": ready, "reason": "R", "message": "m"}]
    return {"metadata": {"name": name}, "status": {"conditions": conditions}}


def test_not_ready_nodes_are_those_whose_ready_condition_is_not_true() -> None:
    found = not_ready_nodes(
        [_node("a", "True"), _node("b", "Unknown"), _node("c", "False"), _node("d", None)]
    )
    assert set(found) == {"b", "c", "d"}
    assert found["b"] == NodeReadiness("Unknown", "R", "m")
    assert found["d"].status == "Unknown"


def test_a_not_ready_member_turns_the_condition_false_naming_it_and_why() -> None:
    cond = nodes_condition(["n1", "n2"], {"n2": UNKNOWN, "other": UNKNOWN}, None, T0)
    assert cond["type"] == CONDITION_NODES_READY
    assert (cond["status"], cond["reason"]) == ("False", REASON_NODE_NOT_READY)
    assert "n2 (Ready=Unknown, NodeStatusUnknown: Kubelet stopped posting node status.)" in cond["message"]
    assert "1 member node(s)" in cond["message"]
    assert "other" not in cond["message"] and "n1" not in cond["message"]


def test_the_transition_time_stays_while_the_status_does() -> None:
    first = nodes_condition(["n1"], {"n1": UNKNOWN}, None, T0)
    later = nodes_condition(["n1"], {"n1": UNKNOWN}, first, T0 + 60_000)
    assert later["lastTransitionTime"] == first["lastTransitionTime"]
    back = nodes_condition(["n1"], {}, later, T0 + 120_000)
    assert back["status"] == "True" and back["lastTransitionTime"] != first["lastTransitionTime"]


def test_the_condition_is_added_after_the_domains_own_only_when_it_has_members() -> None:
    desired = {"status": "Ready", "conditions": [{"type": "Ready", "status": "True"}]}
    assert with_nodes_condition(desired, None, [], {}, T0) == desired
    out = with_nodes_condition(desired, None, ["n1"], {"n1": UNKNOWN}, T0)
    assert [c["type"] for c in out["conditions"]] == ["Ready", CONDITION_NODES_READY]
    assert out["status"] == "Ready"  # the domain's readiness is the IMEX side's
    assert desired["conditions"] == [{"type": "Ready", "status": "True"}]  # not changed in place


def test_events_warn_on_each_change_of_not_ready_nodes_and_note_recovery() -> None:
    ready = {"conditions": [nodes_condition(["n1", "n2"], {}, None, T0)]}
    one = {"conditions": [nodes_condition(["n1", "n2"], {"n1": UNKNOWN}, None, T0)]}
    two = {"conditions": [nodes_condition(["n1", "n2"], {"n1": UNKNOWN, "n2": UNKNOWN}, None, T0)]}
    assert node_events(None, ready) == []
    assert node_events(ready, ready) == []
    [warning] = node_events(ready, one)
    assert (warning.type, warning.reason) == ("Warning", REASON_NODE_NOT_READY) and "n1" in warning.message
    assert node_events(one, one) == []
    assert [e.reason for e in node_events(one, two)] == [REASON_NODE_NOT_READY]
    assert [(e.type, e.reason) for e in node_events(two, ready)] == [("Normal", "NodesReady")]
