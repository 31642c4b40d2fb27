"""Invariant 6 (a running job's imports stay valid through faults that do not kill its nodes), as
`cdsim job check` measures it (tools/cdsim/workload.py): the pure parts, then real simulated IMEX
daemons on loopback whose restart the check must report."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.gen.computedomain.state import v1 as pb
from libs.state.store import Store
from tests.imex.simdomain import CLIQUE, SimCluster, SimNode
from tests.invariants.rig import new_uid
from tools.cdsim import workload
from tools.cdsim.job_book import Importer
from tools.sim.imex.client import Import

JOB = "job-a"
ME = Importer("node-a", "127.0.0.1", (1, 2))


def fabric(
    node: str, index: int, clique: str = CLIQUE, state: pb.MemberState = pb.MemberState.ACTIVE
) -> pb.Member:
    return pb.Member(
        domain_uid="d",
        node_name=node,
        clique_id=clique,
        index=index,
        state=state,
        ip_address=f"127.8.0.{index + 1}",
    )


# ----------------------------------------------------------------------- pure: who imports what


def test_every_fabric_member_imports_from_every_other_member_of_its_clique() -> None:
    members = [
        fabric("b", 1),
        fabric("a", 0),
        fabric("lost", 2, state=pb.MemberState.LOST),  # still exports: its daemon may well run
        fabric("x", 0, clique="other.2"),
        pb.Member(domain_uid="d", node_name="cpu", index=-1),  # non-fabric: no daemon
    ]
    assert workload.expected_imports(members) == [
        Importer("a", "127.8.0.1", (1, 2)),
        Importer("b", "127.8.0.2", (0, 2)),
        Importer("lost", "127.8.0.3", (0, 1)),
        Importer("x", "127.8.0.1", ()),
    ]


@given(st.lists(st.tuples(st.sampled_from(["c1", "c2", ""]), st.integers(-1, 17)), max_size=12, unique=True))
def test_expected_imports_never_from_itself_and_always_within_the_clique(
    layout: list[tuple[str, int]],
) -> None:
    members = [fabric(f"n{i}", index, clique) for i, (clique, index) in enumerate(layout)]
    importers = workload.expected_imports(members)
    holders = {(m.clique_id, m.index): m for m in members if m.clique_id and m.index >= 0}
    assert sorted(i.node for i in importers) == sorted(m.node_name for m in holders.values())
    for importer in importers:
        me = next(m for m in holders.values() if m.node_name == importer.node)
        assert me.index not in importer.sources
        assert set(importer.sources) == {i for c, i in holders if c == me.clique_id and i != me.index}


# ----------------------------------------------------------------------- pure: judging a listing


def test_all_imports_valid_is_intact() -> None:
    found = [
        Import(JOB, 1, "i1", True, ""),
        Import(JOB, 2, "i2", True, ""),
        Import("other", 1, "i1", False, "x"),
    ]
    assert workload.judge(JOB, ME, found) == (2, [])
    report = workload.ImportReport(expected=2, valid=2)
    assert report.intact
    assert not workload.ImportReport(expected=0, valid=0).intact  # a job that imported nothing proves nothing


def test_a_missing_import_is_named() -> None:
    # Another job's import from node 2 does not count for this one.
    found = [Import(JOB, 1, "i1", True, ""), Import("other-job", 2, "i2", True, "")]
    assert workload.judge(JOB, ME, found) == (1, ["node-a: no import from node ID 2"])


def test_an_invalid_import_is_named_with_its_reason() -> None:
    found = [
        Import(JOB, 1, "i1", False, "exporter restarted (was i1, now i9)"),
        Import(JOB, 2, "i2", True, ""),
    ]
    assert workload.judge(JOB, ME, found) == (
        1,
        ["node-a: import from node ID 1 invalid (exporter restarted (was i1, now i9))"],
    )


def test_an_unreachable_daemon_has_lost_every_import() -> None:
    assert workload.judge(JOB, ME, None) == (
        0,
        ["node-a: IMEX daemon not reachable (its imports are gone with it)"],
    )


# ----------------------------------------------------------------------- real daemons


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[SimCluster]:
    sim = SimCluster(tmp_path)
    yield sim
    sim.close()


async def two_member_job(store: Store, cluster: SimCluster) -> tuple[SimNode, SimNode, str]:
    """Two running daemons of one domain and their member records (node-a at 0, node-b at 1)."""
    uid = new_uid()
    a, b = cluster.domain(2, domain_uid=uid)
    for name, node, index in (("node-a", a, 0), ("node-b", b, 1)):
        record = pb.Member(
            domain_uid=uid,
            node_name=name,
            clique_id=CLIQUE,
            index=index,
            state=pb.MemberState.ACTIVE,
            ip_address=node.address,
        )
        await store.put(store.keys.member(uid, name), record)
        node.spawn()
    await a.wait_connected([1])
    await b.wait_connected([0])
    return a, b, uid


async def test_a_reconnect_keeps_the_job_intact_and_a_daemon_restart_is_reported(
    store: Store, cluster: SimCluster
) -> None:
    a, b, uid = await two_member_job(store, cluster)
    importers = await workload.import_all(store, uid, JOB, timeout_s=10)
    assert [(i.node, i.sources) for i in importers] == [("node-a", (1,)), ("node-b", (0,))]
    assert await workload.check(JOB, importers) == workload.ImportReport(expected=2, valid=2)

    # Same instances, new connections (what a hosts rewrite + SIGUSR1 does): nothing is lost.
    for node in (a, b):
        node.signal(signal.SIGUSR1)
    await a.wait_log("Connection established to node 1", count=2)
    await b.wait_log("Connection established to node 0", count=2)
    await a.wait_connected([1])
    assert (await workload.check(JOB, importers)).intact

    # node-b's daemon restarts: a new instance. Its own imports are gone with the old process,
    # and node-a's import of its memory is invalid once node-a sees the new instance.
    old = (await b.status()).instance
    b.kill()
    assert b.proc is not None and b.proc.stderr is not None
    b.proc.stderr.close()
    b.spawn()
    await a.wait_until(
        lambda st: st.connections.get(1) == "CONNECTED" and st.peer_instances.get(1) not in (None, old),
        "the new instance of node 1",
    )
    report = await workload.check(JOB, importers)
    assert not report.intact and (report.expected, report.valid) == (2, 0)
    assert len(report.problems) == 2
    assert report.problems[0].startswith("node-a: import from node ID 1 invalid (")
    assert old in report.problems[0]
    assert report.problems[1] == "node-b: no import from node ID 0"


async def test_a_dead_daemon_is_reported_unreachable(store: Store, cluster: SimCluster) -> None:
    _a, b, uid = await two_member_job(store, cluster)
    importers = await workload.import_all(store, uid, JOB, timeout_s=10)
    b.kill()
    report = await workload.check(JOB, importers)
    assert (report.expected, report.valid) == (2, 1)
    assert report.problems == ("node-b: IMEX daemon not reachable (its imports are gone with it)",)
