"""Domain status and conditions from observed state (pure core)."""

from __future__ import annotations

from libs.gen.computedomain.state import v1 as pb
from services.controller import cdstatus
from services.controller.actions import (
    DeleteDaemonStatus,
    DeleteDomain,
    DeletePreparation,
    MarkMemberLost,
    ReleaseMember,
)
from services.controller.domainrecord import DomainRecord
from services.controller.observed import DaemonRecord, DomainObservation, MemberRecord, NodeRecord
from services.controller.plan import plan_domain

CLIQUE = "uuid-a.1"
GRACE_MS = 30_000


def member(
    node: str, index: int = 0, clique: str = CLIQUE, lost: bool = False, joined: int = 0
) -> MemberRecord:
    return MemberRecord(node, clique, -1 if lost else index, lost, f"127.0.0.{index + 1}", "ns", joined, 10)


def present(*names: str, health: pb.Health = pb.Health.HEALTHY) -> dict[str, NodeRecord]:
    return {n: NodeRecord("127.0.0.1", CLIQUE, health) for n in names}


def daemon(state: pb.DaemonState, error: str = "", updated: int = 0) -> DaemonRecord:
    return DaemonRecord(state, error, updated)


def domain(num_nodes: int = 0, deleting: bool = False) -> DomainRecord:
    return DomainRecord(
        uid="d1", namespace="ns", name="cd", spec=pb.ComputeDomainSpec(num_nodes=num_nodes), deleting=deleting
    )


def obs(**kw) -> DomainObservation:
    kw.setdefault("domain", domain())
    return DomainObservation(uid="d1", domain_revision=7, **kw)


def ready_members(n: int) -> dict:
    names = [f"n{i}" for i in range(n)]
    return {
        "members": {name: member(name, i) for i, name in enumerate(names)},
        "nodes": present(*names),
        "daemons": {name: daemon(pb.DaemonState.READY) for name in names},
    }


def test_new_domain_waits_for_nodes() -> None:
    v = cdstatus.verdict(obs())
    assert not v.ready and v.reason == "WaitingForNodes"
    status = cdstatus.desired_status(obs(), None, now_ms=1000)
    assert not status.ready and status.nodes == ()
    cond = status.condition("Ready")
    assert cond is not None and (cond.status, cond.reason) == ("False", "WaitingForNodes")
    assert cond.last_transition_unix_ms == 1000


def test_all_members_ready_makes_domain_ready_with_node_entries() -> None:
    status = cdstatus.desired_status(obs(**ready_members(3)), None, now_ms=5)
    assert status.ready
    assert [(n.name, n.index, n.clique_id, n.ready) for n in status.nodes] == [
        ("n0", 0, CLIQUE, True),
        ("n1", 1, CLIQUE, True),
        ("n2", 2, CLIQUE, True),
    ]
    assert status.nodes[1].ip_address == "127.0.0.2"
    assert status.condition("Ready") == cdstatus.ConditionEntry(
        "Ready", "True", "AllNodesReady", "3 of 3 node(s) ready", 5
    )
    # The protobuf form carries the same content.
    stored = status.to_pb()
    assert stored.status == pb.Readiness.READY and stored.nodes[2].name == "n2"
    assert cdstatus.StatusValue.from_pb(stored) == status


def test_fewer_members_than_num_nodes_waits() -> None:
    o = obs(domain=domain(num_nodes=4), **ready_members(3))
    v = cdstatus.verdict(o)
    assert not v.ready and v.reason == "WaitingForNodes" and "3 of 4" in v.message
    assert cdstatus.verdict(obs(domain=domain(num_nodes=3), **ready_members(3))).ready


def test_starting_daemon_is_not_ready_and_named() -> None:
    parts = ready_members(2)
    parts["daemons"]["n1"] = daemon(pb.DaemonState.STARTING)
    v = cdstatus.verdict(obs(**parts))
    assert not v.ready and v.reason == "ImexDaemonsNotReady" and "n1" in v.message
    parts["daemons"].pop("n1")
    assert cdstatus.verdict(obs(**parts)).reason == "ImexDaemonsNotReady"


def test_failed_daemon_reports_its_error() -> None:
    parts = ready_members(2)
    parts["daemons"]["n0"] = daemon(pb.DaemonState.FAILED, "bind 127.0.0.1:50000: address in use")
    v = cdstatus.verdict(obs(**parts))
    assert v.reason == "ImexDaemonFailed" and "n0" in v.message and "address in use" in v.message
    # A crashed daemon being restarted reports NOT_READY with the exit reason.
    parts["daemons"]["n0"] = daemon(pb.DaemonState.NOT_READY, "exited with code 1")
    assert cdstatus.verdict(obs(**parts)).reason == "ImexDaemonFailed"


def test_node_record_gone_means_lost_even_before_marked() -> None:
    parts = ready_members(4)
    del parts["nodes"]["n2"]
    status = cdstatus.desired_status(obs(**parts), None, now_ms=1)
    cond = status.condition("Ready")
    assert not status.ready
    assert cond is not None and cond.reason == "NodeLost" and "n2" in cond.message
    n2 = next(n for n in status.nodes if n.name == "n2")
    assert not n2.ready and n2.index == -1


def test_lost_member_keeps_domain_not_ready_even_when_enough_nodes() -> None:
    parts = ready_members(4)
    parts["members"]["old"] = member("old", lost=True)
    o = obs(domain=domain(num_nodes=4), **parts)
    v = cdstatus.verdict(o)
    assert not v.ready and v.reason == "NodeLost" and "old" in v.message


def test_non_fabric_member_ready_when_node_present_and_healthy() -> None:
    m = {"cpu0": member("cpu0", clique="")}
    assert cdstatus.verdict(obs(members=m, nodes=present("cpu0"))).ready
    unhealthy = present("cpu0", health=pb.Health.UNHEALTHY)
    assert not cdstatus.verdict(obs(members=m, nodes=unhealthy)).ready
    status = cdstatus.desired_status(obs(members=m, nodes=present("cpu0")), None, 0)
    assert (status.nodes[0].clique_id, status.nodes[0].index, status.nodes[0].ready) == ("", -1, True)


def test_deleting_domain_is_terminating() -> None:
    v = cdstatus.verdict(obs(domain=domain(deleting=True), **ready_members(2)))
    assert not v.ready and v.reason == "Terminating" and "2 member" in v.message


def test_transition_time_changes_only_when_condition_status_changes() -> None:
    parts = ready_members(2)
    parts["daemons"]["n1"] = daemon(pb.DaemonState.STARTING)
    first = cdstatus.desired_status(obs(**parts), None, now_ms=100)
    # Same status (False) with a different reason and message: time stays.
    parts["daemons"]["n1"] = daemon(pb.DaemonState.FAILED, "boom")
    second = cdstatus.desired_status(obs(**parts), first, now_ms=200)
    assert second.conditions[0].last_transition_unix_ms == 100
    assert second.conditions[0].reason == "ImexDaemonFailed"
    parts["daemons"]["n1"] = daemon(pb.DaemonState.READY)
    third = cdstatus.desired_status(obs(**parts), second, now_ms=300)
    assert third.conditions[0].last_transition_unix_ms == 300
    # Recomputing an unchanged situation is not a change.
    assert cdstatus.desired_status(obs(**parts), third, now_ms=400) == third


def test_plan_writes_status_only_on_change() -> None:
    o = obs(**ready_members(2))
    plan = plan_domain(o, now_ms=10, orphan_grace_ms=GRACE_MS)
    assert plan.status is not None and plan.status.ready and plan.actions == []
    again = plan_domain(obs(**ready_members(2), status=plan.status), now_ms=20, orphan_grace_ms=GRACE_MS)
    assert again.status is None


def test_plan_marks_lost_nodes() -> None:
    parts = ready_members(3)
    del parts["nodes"]["n1"]
    plan = plan_domain(obs(**parts), 0, GRACE_MS)
    assert plan.actions == [MarkMemberLost("n1")]


def test_plan_releases_lost_member_without_claims_but_keeps_one_with_claims() -> None:
    members = {"a": member("a", lost=True), "b": member("b", lost=True)}
    o = obs(members=members, nodes=present("a"), preparations={"b": frozenset({"c1"})})
    actions = plan_domain(o, 0, GRACE_MS).actions
    assert [(type(a), getattr(a, "node", None)) for a in actions] == [(ReleaseMember, "a")]


def test_teardown_waits_for_active_members_then_deletes_domain() -> None:
    d = domain(deleting=True)
    busy = obs(domain=d, **ready_members(1), preparations={"n0": frozenset({"c"})})
    assert plan_domain(busy, 0, GRACE_MS).actions == []
    # The agent unprepared and left: nothing remains but the record.
    assert plan_domain(obs(domain=d), 0, GRACE_MS).actions == [DeleteDomain(7)]


def test_teardown_drops_claims_of_gone_nodes_first() -> None:
    d = domain(deleting=True)
    o = obs(domain=d, members={"x": member("x", lost=True)}, preparations={"x": frozenset({"c2", "c1"})})
    actions = plan_domain(o, 0, GRACE_MS).actions
    assert actions == [DeletePreparation("x", "c1"), DeletePreparation("x", "c2")]
    after = obs(domain=d, members={"x": member("x", lost=True)})
    assert [type(a) for a in plan_domain(after, 0, GRACE_MS).actions] == [ReleaseMember]


def test_records_of_a_missing_domain_are_released_after_grace() -> None:
    o = obs(domain=None, members={"n": member("n", joined=1_000)}, daemons={"z": daemon(2, updated=1_000)})
    early = plan_domain(o, now_ms=2_000, orphan_grace_ms=GRACE_MS)
    assert early.actions == [] and early.recheck_after_ms == GRACE_MS - 1_000
    late = plan_domain(o, now_ms=1_000 + GRACE_MS, orphan_grace_ms=GRACE_MS)
    assert [type(a) for a in late.actions] == [ReleaseMember, DeleteDaemonStatus]
    assert late.status is None
