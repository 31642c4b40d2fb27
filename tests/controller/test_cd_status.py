"""Domain status and conditions from observed state (pure core)."""

from __future__ import annotations

from libs.gen.computedomain.state import v1 as pb
from libs.state.domain_record import DomainRecord
from services.controller import cd_status
from services.controller.actions import (
    ActivateMember,
    DeleteDaemonStatus,
    DeleteDomain,
    DeletePreparation,
    MarkMemberLost,
    ReleaseMember,
)
from services.controller.observed import DaemonRecord, DomainObservation, MemberRecord, NodeRecord
from services.controller.plan import plan_domain

CLIQUE = "uuid-a.1"
GRACE_MS = 30_000


def member(
    node: str, index: int = 0, clique: str = CLIQUE, lost: bool = False, joined: int = 0, revision: int = 10
) -> MemberRecord:
    return MemberRecord(node, clique, index, lost, f"127.0.0.{index + 1}", "ns", joined, revision)


def present(*names: str, health: pb.Health = pb.Health.HEALTHY, ip: str = "") -> dict[str, NodeRecord]:
    # No address: the members' own stand (a different one would ask for an address update).
    return {n: NodeRecord(ip, CLIQUE, health) for n in names}


def daemon(
    state: pb.DaemonState,
    error: str = "",
    updated: int = 0,
    connected: tuple[str, ...] = (),
    revision: int = 0,
) -> DaemonRecord:
    return DaemonRecord(state, error, updated, frozenset(connected), revision)


def domain(num_nodes: int = 0, deleting: bool = False) -> DomainRecord:
    return DomainRecord(
        uid="d1",
        namespace="ns",
        name="cd",
        spec=pb.ComputeDomainSpec(num_nodes=num_nodes),
        deleting=deleting,
        mesh_mode=pb.MeshMode.PLAINTEXT,  # decided (the mesh's own decisions are tested apart)
    )


def obs(**kw) -> DomainObservation:
    kw.setdefault("domain", domain())
    return DomainObservation(uid="d1", domain_revision=7, **kw)


def ready_members(n: int) -> dict:
    """n fabric members of one clique, every daemon READY and connected to all the others."""
    names = [f"n{i}" for i in range(n)]
    return {
        "members": {name: member(name, i) for i, name in enumerate(names)},
        "nodes": present(*names),
        "daemons": {
            name: daemon(
                pb.DaemonState.READY, connected=tuple(p for p in names if p != name), revision=100 + i
            )
            for i, name in enumerate(names)
        },
    }


def disconnect(parts: dict, gone: str) -> None:
    """Every daemon stops reporting `gone` connected (its links to it dropped)."""
    for name, d in list(parts["daemons"].items()):
        if name != gone:
            parts["daemons"][name] = DaemonRecord(
                d.state, d.last_error, d.updated_unix_ms, d.connected_nodes - {gone}, d.mod_revision + 1
            )


def test_new_domain_waits_for_nodes() -> None:
    v = cd_status.ready_condition(obs())
    assert not v.ready and v.reason == "WaitingForNodes"
    status = cd_status.desired_status(obs(), None, now_ms=1000)
    assert not status.ready and status.nodes == ()
    cond = status.condition("Ready")
    assert cond is not None and (cond.status, cond.reason) == ("False", "WaitingForNodes")
    assert cond.last_transition_unix_ms == 1000


def test_all_members_ready_makes_domain_ready_with_node_entries() -> None:
    status = cd_status.desired_status(obs(**ready_members(3)), None, now_ms=5)
    assert status.ready
    assert [(n.name, n.index, n.clique_id, n.ready) for n in status.nodes] == [
        ("n0", 0, CLIQUE, True),
        ("n1", 1, CLIQUE, True),
        ("n2", 2, CLIQUE, True),
    ]
    assert status.nodes[1].ip_address == "127.0.0.2"
    assert status.condition("Ready") == cd_status.ConditionEntry(
        "Ready", "True", "AllNodesReady", "3 of 3 node(s) ready", 5
    )
    # The protobuf form carries the same content.
    stored = status.to_pb()
    assert stored.status == pb.Readiness.READY and stored.nodes[2].name == "n2"
    assert cd_status.StatusValue.from_pb(stored) == status


def test_fewer_members_than_num_nodes_waits() -> None:
    o = obs(domain=domain(num_nodes=4), **ready_members(3))
    v = cd_status.ready_condition(o)
    assert not v.ready and v.reason == "WaitingForNodes" and "3 of 4" in v.message
    assert cd_status.ready_condition(obs(domain=domain(num_nodes=3), **ready_members(3))).ready


def test_starting_daemon_is_not_ready_and_named() -> None:
    parts = ready_members(2)
    parts["daemons"]["n1"] = daemon(pb.DaemonState.STARTING)
    v = cd_status.ready_condition(obs(**parts))
    assert not v.ready and v.reason == "ImexDaemonsNotReady" and "n1" in v.message
    parts["daemons"].pop("n1")
    assert cd_status.ready_condition(obs(**parts)).reason == "ImexDaemonsNotReady"


def test_failed_daemon_reports_its_error() -> None:
    parts = ready_members(2)
    parts["daemons"]["n0"] = daemon(pb.DaemonState.FAILED, "bind 127.0.0.1:50000: address in use")
    v = cd_status.ready_condition(obs(**parts))
    assert v.reason == "ImexDaemonFailed" and "n0" in v.message and "address in use" in v.message
    # A crashed daemon being restarted reports NOT_READY with the exit reason.
    parts["daemons"]["n0"] = daemon(pb.DaemonState.NOT_READY, "exited with code 1")
    assert cd_status.ready_condition(obs(**parts)).reason == "ImexDaemonFailed"


def test_node_record_gone_while_peers_report_it_connected_is_not_lost() -> None:
    """Only the node's IMEX side is gone (its daemon still talks to its peers): nothing is lost."""
    parts = ready_members(4)
    del parts["nodes"]["n2"]
    o = obs(**parts)
    status = cd_status.desired_status(o, None, now_ms=1)
    assert status.ready and status.condition("Ready").reason == "AllNodesReady"  # type: ignore[union-attr]
    assert plan_domain(o, 0, GRACE_MS).actions == []
    # One peer is enough to vouch for it.
    disconnect(parts, "n2")
    parts["daemons"]["n3"] = daemon(pb.DaemonState.READY, connected=("n0", "n1", "n2"), revision=7)
    assert plan_domain(obs(**parts), 0, GRACE_MS).actions == []


def test_node_record_gone_and_no_peer_connected_is_lost_keeping_its_index() -> None:
    parts = ready_members(4)
    del parts["nodes"]["n2"]
    disconnect(parts, "n2")
    status = cd_status.desired_status(obs(**parts), None, now_ms=1)
    cond = status.condition("Ready")
    assert not status.ready
    assert cond is not None and cond.reason == "NodeLost"
    assert "n2 (index 2)" in cond.message and "indices are kept" in cond.message
    n2 = next(n for n in status.nodes if n.name == "n2")
    assert not n2.ready and n2.index == 2
    # The other members are ready: nobody needs to reach a lost node.
    assert all(n.ready for n in status.nodes if n.name != "n2")


def test_reports_of_peers_that_are_gone_too_do_not_vouch() -> None:
    """Two nodes die together: each one's last report lists the other; neither report counts."""
    parts = ready_members(3)
    del parts["nodes"]["n0"], parts["nodes"]["n1"]
    disconnect(parts, "n0")
    disconnect(parts, "n1")
    parts["daemons"]["n0"] = daemon(pb.DaemonState.READY, connected=("n1", "n2"))
    parts["daemons"]["n1"] = daemon(pb.DaemonState.READY, connected=("n0", "n2"))
    actions = plan_domain(obs(**parts), 0, GRACE_MS).actions
    assert [a.node for a in actions if isinstance(a, MarkMemberLost)] == ["n0", "n1"]


def test_member_alone_in_its_clique_is_lost_when_its_record_is_gone() -> None:
    parts = ready_members(1)
    del parts["nodes"]["n0"]
    o = obs(**parts)
    assert cd_status.ready_condition(o).reason == "NodeLost"
    assert plan_domain(o, 0, GRACE_MS).actions == [MarkMemberLost("n0", ())]
    cpu = obs(members={"cpu0": member("cpu0", clique="")})
    assert plan_domain(cpu, 0, GRACE_MS).actions == [MarkMemberLost("cpu0", ())]


def test_lost_member_keeps_domain_not_ready_even_when_enough_nodes() -> None:
    parts = ready_members(4)
    parts["members"]["old"] = member("old", index=4, lost=True)
    o = obs(domain=domain(num_nodes=4), **parts)
    v = cd_status.ready_condition(o)
    assert not v.ready and v.reason == "NodeLost" and "old (index 4)" in v.message
    entry = next(n for n in cd_status.desired_status(o, None, 0).nodes if n.name == "old")
    assert (entry.index, entry.ready) == (4, False)


def test_ready_requires_every_daemon_connected_to_every_active_peer() -> None:
    parts = ready_members(3)
    parts["daemons"]["n0"] = daemon(pb.DaemonState.READY, connected=("n1",))
    parts["daemons"]["n2"] = daemon(pb.DaemonState.READY, connected=())
    status = cd_status.desired_status(obs(**parts), None, now_ms=1)
    cond = status.condition("Ready")
    assert not status.ready and cond is not None and cond.reason == "WaitingForPeers"
    assert "1 of 3 node(s) ready" in cond.message
    assert "n0 to n2" in cond.message and "n2 to n0, n1" in cond.message
    assert [(n.name, n.ready) for n in status.nodes] == [("n0", False), ("n1", True), ("n2", False)]


def test_a_daemon_still_starting_is_named_before_missing_connections() -> None:
    parts = ready_members(3)
    parts["daemons"]["n2"] = daemon(pb.DaemonState.STARTING)
    disconnect(parts, "n2")
    v = cd_status.ready_condition(obs(**parts))
    assert v.reason == "ImexDaemonsNotReady" and "2 of 3 node(s) up; waiting for n2" in v.message


def test_mesh_is_per_clique_and_leaves_out_non_fabric_members() -> None:
    members = {
        "a0": member("a0", 0),
        "a1": member("a1", 1),
        "b0": member("b0", 0, clique="uuid-b.1"),
        "cpu": member("cpu", clique=""),
    }
    daemons = {
        "a0": daemon(pb.DaemonState.READY, connected=("a1",)),
        "a1": daemon(pb.DaemonState.READY, connected=("a0",)),
        "b0": daemon(pb.DaemonState.READY),
    }
    assert cd_status.ready_condition(obs(members=members, nodes=present(*members), daemons=daemons)).ready


def test_non_fabric_member_ready_when_node_present_and_healthy() -> None:
    m = {"cpu0": member("cpu0", clique="")}
    assert cd_status.ready_condition(obs(members=m, nodes=present("cpu0"))).ready
    unhealthy = present("cpu0", health=pb.Health.UNHEALTHY)
    assert not cd_status.ready_condition(obs(members=m, nodes=unhealthy)).ready
    status = cd_status.desired_status(obs(members=m, nodes=present("cpu0")), None, 0)
    assert (status.nodes[0].clique_id, status.nodes[0].index, status.nodes[0].ready) == ("", -1, True)


def test_deleting_domain_is_terminating() -> None:
    v = cd_status.ready_condition(obs(domain=domain(deleting=True), **ready_members(2)))
    assert not v.ready and v.reason == "Terminating" and "2 member" in v.message


def test_transition_time_changes_only_when_condition_status_changes() -> None:
    parts = ready_members(2)
    parts["daemons"]["n1"] = daemon(pb.DaemonState.STARTING)
    first = cd_status.desired_status(obs(**parts), None, now_ms=100)
    # Same status (False) with a different reason and message: time stays.
    parts["daemons"]["n1"] = daemon(pb.DaemonState.FAILED, "boom")
    second = cd_status.desired_status(obs(**parts), first, now_ms=200)
    assert second.conditions[0].last_transition_unix_ms == 100
    assert second.conditions[0].reason == "ImexDaemonFailed"
    parts["daemons"]["n1"] = daemon(pb.DaemonState.READY, connected=("n0",))
    third = cd_status.desired_status(obs(**parts), second, now_ms=300)
    assert third.conditions[0].last_transition_unix_ms == 300
    # Recomputing an unchanged situation is not a change.
    assert cd_status.desired_status(obs(**parts), third, now_ms=400) == third


def test_plan_writes_status_only_on_change() -> None:
    o = obs(**ready_members(2))
    plan = plan_domain(o, now_ms=10, orphan_grace_ms=GRACE_MS)
    assert plan.status is not None and plan.status.ready and plan.actions == []
    again = plan_domain(obs(**ready_members(2), status=plan.status), now_ms=20, orphan_grace_ms=GRACE_MS)
    assert again.status is None


def test_plan_marks_a_node_lost_only_once_no_peer_reports_it() -> None:
    parts = ready_members(3)
    del parts["nodes"]["n1"]
    assert plan_domain(obs(**parts), 0, GRACE_MS).actions == []
    disconnect(parts, "n1")
    plan = plan_domain(obs(**parts), 0, GRACE_MS)
    # The decision names the reports it relied on, to be compared when it is applied.
    assert plan.actions == [MarkMemberLost("n1", (("n0", 101), ("n2", 103)))]


def test_plan_releases_lost_member_without_claims_but_keeps_one_with_claims() -> None:
    members = {"a": member("a", 0, lost=True), "b": member("b", 1, lost=True)}
    o = obs(members=members, nodes=present("a"), preparations={"b": frozenset({"c1"})})
    actions = plan_domain(o, 0, GRACE_MS).actions
    assert actions == [ReleaseMember("a", CLIQUE, 0, 10, "node back without claims of this domain")]


def test_plan_makes_a_returned_node_with_claims_active_again() -> None:
    members = {"a": member("a", 3, lost=True, revision=42), "b": member("b", 1)}
    o = obs(members=members, nodes=present("a", "b"), preparations={"a": frozenset({"c1"})})
    assert plan_domain(o, 0, GRACE_MS).actions == [ActivateMember("a", 42, "node back", ("c1",))]
    # Still away: it waits, keeping its index.
    away = obs(members=members, nodes=present("b"), preparations={"a": frozenset({"c1"})})
    assert plan_domain(away, 0, GRACE_MS).actions == []


def test_plan_updates_the_address_of_a_member_whose_node_moved() -> None:
    o = obs(members={"a": member("a", 0)}, nodes=present("a", ip="127.0.9.9"))
    assert plan_domain(o, 0, GRACE_MS).actions == [ActivateMember("a", 10, "node address changed")]
    same = obs(members={"a": member("a", 0)}, nodes=present("a", ip="127.0.0.1"))
    assert plan_domain(same, 0, GRACE_MS).actions == []


def test_plan_leaves_a_lost_member_from_before_kept_indices_to_its_agent() -> None:
    legacy = {"a": member("a", -1, lost=True)}
    o = obs(members=legacy, nodes=present("a"), preparations={"a": frozenset({"c1"})})
    assert plan_domain(o, 0, GRACE_MS).actions == []


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


def _with_reason(
    state: pb.DaemonState, reason: str, error: str, connected: tuple[str, ...] = ()
) -> DaemonRecord:
    return DaemonRecord(state, error, 0, frozenset(connected), 0, reason)


def test_a_daemon_waiting_for_recovery_is_the_reason_with_what_it_waits_for() -> None:
    parts = ready_members(3)
    waiting = "IMEX daemon WAITING_FOR_RECOVERY: ...; members not connected now: n2 (slot 2)"
    parts["daemons"]["n0"] = _with_reason(
        pb.DaemonState.STARTING, "ImexDaemonWaitingForRecovery", waiting, ("n1", "n2")
    )
    v = cd_status.ready_condition(obs(**parts))
    assert not v.ready and v.reason == "ImexDaemonWaitingForRecovery"
    assert v.message.startswith("IMEX daemon waiting for recovery on n0: ") and "n2 (slot 2)" in v.message
    # While a member is lost, NodeLost leads, and its message names the waiting daemon too.
    parts["members"]["n2"] = member("n2", 2, lost=True)
    v = cd_status.ready_condition(obs(**parts))
    assert v.reason == "NodeLost" and "n2 (index 2)" in v.message
    assert "IMEX daemon waiting for recovery on n0" in v.message


def test_a_node_whose_driver_is_too_old_is_the_reason_before_other_failures() -> None:
    parts = ready_members(3)
    parts["daemons"]["n1"] = _with_reason(
        pb.DaemonState.FAILED, "ImexDriverTooOld", "driver 570.133.20 is older than 570.158.01: ..."
    )
    parts["daemons"]["n2"] = daemon(pb.DaemonState.FAILED, "exited with status 1")
    v = cd_status.ready_condition(obs(**parts))
    assert v.reason == "ImexDriverTooOld"
    assert v.message == "IMEX daemon not started on n1: driver 570.133.20 is older than 570.158.01: ..."
