"""Invariant 6 bookkeeping of the soak: which faults excuse a job's broken imports, what a check
result means, and what a killed node must hold when it comes back."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from libs.gen.computedomain.state import v1 as pb
from tools.cdsim.workload import ImportReport
from tools.chaos import continuity as c
from tools.chaos import plan as p

NODES = ("n0", "n1", "n2", "n3")


def test_only_faults_that_replace_a_daemon_excuse_broken_imports() -> None:
    assert p.BREAKS_IMPORTS == {p.KILL_NODE, p.IMEX_CRASH, p.IMEX_HANG, p.IMEX_KILL}
    # A plugin or IMEX agent killed, etcd restarted: running jobs must not notice.
    assert not {p.KILL_AGENT, p.KILL_IMEX_AGENT, p.ETCD_RESTART, p.CONTROLLER_FAILOVER} & p.BREAKS_IMPORTS
    assert p.BREAKS_IMPORTS <= set(p.FAULTS)


def test_a_fault_on_a_member_while_the_job_is_armed_exempts_it() -> None:
    ledger = c.FaultLedger()
    before = ledger.begin("n1", p.IMEX_CRASH, 10.0)
    ledger.end(before, 12.0)
    # Over before the job was armed at 20 s: its imports were made against the new daemon.
    assert ledger.exempting({"n1", "n2"}, armed_s=20.0) is None
    hang = ledger.begin("n2", p.IMEX_HANG, 18.0)
    # Begun before the arming but still under way (the hung daemon not yet replaced).
    assert ledger.exempting({"n1", "n2"}, armed_s=20.0) is hang
    ledger.end(hang, 40.0)
    assert ledger.exempting({"n1", "n2"}, armed_s=20.0) is hang
    assert ledger.exempting({"n1", "n2"}, armed_s=41.0) is None
    # Another job's node: nothing to excuse.
    ledger.begin("n3", p.KILL_NODE, 50.0)
    assert ledger.exempting({"n1", "n2"}, armed_s=41.0) is None
    assert "kill-node on n3 at 50.0s" == ledger.exempting({"n3"}, 0.0).describe()  # type: ignore[union-attr]


@given(
    faults=st.lists(
        st.tuples(
            st.sampled_from(NODES),
            st.floats(0, 100),
            st.one_of(st.none(), st.floats(0, 50)),
        ),
        max_size=8,
    ),
    nodes=st.sets(st.sampled_from(NODES)),
    armed=st.floats(0, 150),
)
def test_exemption_is_any_overlap_with_the_armed_time(
    faults: list[tuple[str, float, float | None]], nodes: set[str], armed: float
) -> None:
    ledger = c.FaultLedger()
    for node, began, length in faults:
        fault = ledger.begin(node, p.IMEX_KILL, began)
        if length is not None:
            ledger.end(fault, began + length)
    overlapping = [f for f in ledger.faults if f.node in nodes and (f.ended_s is None or f.ended_s >= armed)]
    assert ledger.exempting(nodes, armed) == (overlapping[0] if overlapping else None)


def test_a_silent_daemon_is_inconclusive_an_invalid_import_is_broken() -> None:
    assert c.verdict(ImportReport(4, 4)) == c.INTACT
    silent = ImportReport(4, 3, ("n1: IMEX daemon not reachable (its imports are gone with it)",))
    assert c.verdict(silent) == c.INCONCLUSIVE
    invalid = ImportReport(
        4, 2, (silent.problems[0], "n2: import from node ID 0 invalid (exporter said BYE)")
    )
    assert c.verdict(invalid) == c.BROKEN
    assert c.verdict(ImportReport(4, 3, ("n2: no import from node ID 1",))) == c.BROKEN
    text = c.broken_imports("ns/j1 (2 nodes)", invalid, 12.5)
    assert text.startswith("inv6: job ns/j1 (2 nodes) lost imports") and "exporter said BYE" in text


def _member(node: str, index: int, state: pb.MemberState = pb.MemberState.ACTIVE) -> pb.Member:
    return pb.Member(domain_uid="d1", node_name=node, index=index, state=state)


def _daemon(
    node: str, instance: str, node_id: int, state: pb.DaemonState = pb.DaemonState.READY
) -> pb.DaemonStatus:
    return pb.DaemonStatus(domain_uid="d1", node_name=node, instance=instance, node_id=node_id, state=state)


def test_a_killed_node_must_come_back_with_its_index() -> None:
    want = c.IndexExpectation("d1", "n1", 3, "ns/j1", old_instance="i-old")
    key = ("d1", "n1")
    old = {key: _daemon("n1", "i-old", 3)}
    new = {key: _daemon("n1", "i-new", 3)}
    # Away (LOST, same index; its old daemon's record still there): fine while the faults go on.
    lost = {key: _member("n1", 3, pb.MemberState.LOST)}
    assert c.index_findings([want], lost, old, {"d1"}, quiescent=False) == ([], [])
    # Not back yet at a quiescence: a violation, whatever the member says.
    for members, daemons in ((lost, new), ({}, {}), ({key: _member("n1", 3)}, old)):
        found, settled = c.index_findings([want], members, daemons, {"d1"}, quiescent=True)
        assert settled == [] and "did not take its index 3" in found[0]
    # Back (a new daemon instance READY, the member ACTIVE with its index): met, at any time.
    back = {key: _member("n1", 3)}
    assert c.index_findings([want], back, new, {"d1"}, quiescent=False) == ([], [want])
    assert c.index_findings([want], back, new, {"d1"}, quiescent=True) == ([], [want])
    # Another index: a violation at once.
    moved = {key: _member("n1", 5)}
    found, _ = c.index_findings([want], moved, old, {"d1"}, quiescent=False)
    assert found == [
        "inv6: n1 came back to the domain of job ns/j1 with index 5; it held index 3 when it was killed"
    ]
    # The new daemon identified itself as another node ID.
    found, _ = c.index_findings([want], back, {key: _daemon("n1", "i-new", 4)}, {"d1"}, quiescent=False)
    assert found and "identified itself as node ID 4" in found[0]
    # The job was deleted: nothing to expect any more.
    assert c.index_findings([want], moved, {}, set(), quiescent=True) == ([], [want])
