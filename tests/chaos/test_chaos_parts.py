"""The soak's parts that need no cluster: seeded decisions, the store snapshot, crash accounting."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.gen.computedomain.state import v1 as pb
from libs.invariants.checker import check_store_invariants
from libs.state.store import Put, Store
from tools.cdsim.layout import StateLayout
from tools.chaos import checks
from tools.chaos import plan as p
from tools.chaos.event_log import EventLog
from tools.chaos.snapshot import StoreSnapshot
from tools.chaos.tracking import failover_time

CLIQUE = "c0ffee00-0000-5000-8000-000000000000.7"


def test_one_seed_gives_one_sequence_of_decisions() -> None:
    a, b, c = p.Plan(42), p.Plan(42), p.Plan(43)
    run_a = [a.next_step() for _ in range(300)]
    run_b = [b.next_step() for _ in range(300)]
    run_c = [c.next_step() for _ in range(300)]
    assert run_a == run_b
    assert run_a != run_c
    assert [a.steps_until_quiescence() for _ in range(5)] == [b.steps_until_quiescence() for _ in range(5)]


def test_decisions_stay_in_their_ranges() -> None:
    plan = p.Plan(9)
    steps = [plan.next_step() for _ in range(2000)]
    assert {s.job_size for s in steps} <= set(range(1, 19)) and max(s.job_size for s in steps) == 18
    assert {s.namespace for s in steps} == set(p.NAMESPACES)
    assert any(s.all_channels for s in steps) and not all(s.all_channels for s in steps)
    assert all(0.4 <= s.delay_s <= 2.0 and all(0 <= x < 1 for x in s.picks) for s in steps)
    assert {s.action for s in steps} == set(p.JOB_ACTIONS) | set(p.FAULTS)


def test_every_fault_comes_early_and_a_skipped_one_comes_again() -> None:
    plan = p.Plan(5)
    faults: list[str] = []
    while len(faults) < len(p.FAULTS):
        step = plan.next_step()
        if step.action in p.FAULTS:
            faults.append(step.action)
    assert sorted(faults) == sorted(p.FAULTS)
    plan.not_done(p.IMEX_HANG)
    while (step := plan.next_step()).action not in p.FAULTS:
        pass
    assert step.action == p.IMEX_HANG


def test_a_soak_with_its_own_fault_kinds_does_each_early_and_refuses_unknown_weights() -> None:
    """The Kubernetes-mode soak (tools/chaoskube) plans with its own fault kinds."""
    kinds = ("kubelet-restart", "node-lost")
    weights = {p.JOB_SUBMIT: 1.0, "kubelet-restart": 1.0, "node-lost": 1.0}
    plan = p.Plan(5, weights=weights, faults=kinds)
    faults = [s.action for s in (plan.next_step() for _ in range(40)) if s.action != p.JOB_SUBMIT]
    assert sorted(faults[:2]) == sorted(kinds) and set(faults) <= set(kinds)
    with pytest.raises(ValueError, match="unknown actions"):
        p.Plan(5, weights={**weights, p.KILL_NODE: 1.0}, faults=kinds)


def test_weights_choose_the_actions() -> None:
    plan = p.Plan(1, weights={p.JOB_SUBMIT: 1.0, p.KILL_AGENT: 1.0})
    assert {plan.next_step().action for _ in range(200)} == {p.JOB_SUBMIT, p.KILL_AGENT}


def test_pick_covers_the_list_and_handles_empty() -> None:
    items = ["a", "b", "c"]
    assert [p.pick(items, f) for f in (0.0, 0.34, 0.67, 0.999)] == ["a", "b", "c", "c"]
    assert p.pick([], 0.5) is None


def test_event_log_counts_and_renders() -> None:
    now = [100.0]
    log = EventLog(clock=lambda: now[0])
    now[0] = 101.5
    log.add("fault", "kill-agent", "rack0-tray1", count="fault kill-agent")
    log.violation("inv1: node n is a member of 2 domains")
    assert log.counts["fault kill-agent"] == 1
    assert log.render().splitlines() == [
        "     1.50s  fault     kill-agent  rack0-tray1",
        "     1.50s  violation inv1: node n is a member of 2 domains",
    ]
    assert log.summary("fault ") == ["     1  kill-agent"]


def _member(domain: str, node: str, index: int) -> pb.Member:
    return pb.Member(
        domain_uid=domain,
        node_name=node,
        clique_id=CLIQUE,
        index=index,
        state=pb.MemberState.ACTIVE,
        ip_address=f"127.9.0.{index + 1}",
        namespace="ns",
    )


async def test_snapshot_answers_like_the_store_at_one_revision(store: Store) -> None:
    k = store.keys
    await store.txn(
        [],
        [
            Put(k.domain("d1"), pb.ComputeDomain(uid="d1", namespace="ns", name="d1")),
            Put(k.domain("d2"), pb.ComputeDomain(uid="d2", namespace="ns", name="d2")),
            Put(k.member("d1", "n0"), _member("d1", "n0", 0)),
            Put(k.member("d2", "n0"), _member("d2", "n0", 0)),  # invariant 1 broken on purpose
        ],
    )
    await store.put_raw(k.domains() + "garbage", b"\xff not an envelope")
    snapshot = await StoreSnapshot.take(store)
    # A write after the snapshot is not seen by it.
    await store.put(k.domain("d3"), pb.ComputeDomain(uid="d3", namespace="ns", name="d3"))
    domains, revision = await snapshot.list(k.domains(), pb.ComputeDomain)
    assert [d.value.uid for d in domains] == ["d1", "d2"] and revision == snapshot.revision_read
    assert (await snapshot.get(k.domain("d1"), pb.ComputeDomain)) is not None
    assert await snapshot.get(k.domain("d3"), pb.ComputeDomain) is None
    assert await snapshot.get(k.domains() + "garbage", pb.ComputeDomain) is None
    from_snapshot = await check_store_invariants(snapshot, quiescent=False)
    assert from_snapshot == await check_store_invariants(store, quiescent=False)
    assert any(v.startswith("inv1: node n0") for v in from_snapshot)


def test_restarts_beyond_the_kills_are_crashes() -> None:
    base = {"agent-a": checks.ProcessCount(0, "", True, True), "etcd": checks.ProcessCount(0, "", True, True)}
    now = {
        "agent-a": checks.ProcessCount(3, "exited with code 1", True, True),
        "etcd": checks.ProcessCount(2, "stopped by cdsim fault restart-etcd", True, True),
        "controller-0": checks.ProcessCount(0, "", False, False),
    }
    found = checks.unexplained_restarts(base, now, {"agent-a": 2, "etcd": 2})
    assert found == [
        "crash: agent-a restarted 1 time(s) more than the soak killed it (last exit: exited with code 1)"
    ]
    assert checks.not_running(now) == ["controller-0"]


def test_error_lines_of_the_service_logs_are_counted(tmp_path: Path) -> None:
    layout = StateLayout.at(tmp_path)
    layout.logs_dir.mkdir()
    lines = [
        json.dumps({"level": "error", "event": "skipping undecodable value", "key": "/x"}),
        json.dumps({"level": "info", "event": "claim prepared"}),
        json.dumps({"level": "error", "msg": "etcd said no"}),
        "Traceback (most recent call last):",
        "not json at all",
    ]
    (layout.logs_dir / "agent-rack0-tray1.log").write_text("\n".join(lines[:2] + lines[3:]) + "\n")
    (layout.logs_dir / "etcd.log").write_text(lines[2] + "\n")
    (layout.logs_dir / "imex-rack0-tray1.log").write_text(lines[0] + "\n")
    assert checks.error_log_lines(layout) == {
        "agent: error skipping undecodable value": 1,
        "agent: uncaught traceback": 1,
        "etcd: error etcd said no": 1,
        "imex-agent: error skipping undecodable value": 1,
    }


@pytest.fixture
def fake_daemon(tmp_path: Path) -> Iterator[tuple[StateLayout, int]]:
    """A process that looks like a simulated IMEX daemon of domain d1 on node n1 to the scan."""
    layout = StateLayout.at(tmp_path)
    config = layout.node("n1").imex_dir / "d1" / "config.cfg"
    fake = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "run_daemon.py", "-c", str(config)]
    )
    try:
        yield layout, fake.pid
    finally:
        fake.kill()
        fake.wait()


async def test_a_daemon_of_a_domain_its_node_left_is_found(
    store: Store, fake_daemon: tuple[StateLayout, int]
) -> None:
    layout, pid = fake_daemon
    found = await checks.stray_daemons(store, layout, ["n0", "n1"])
    assert found == [f"inv5: IMEX daemon pid {pid} on n1 serves domain d1, of which n1 is not a member"]
    await store.put(store.keys.member("d1", "n1"), _member("d1", "n1", 0))
    assert await checks.stray_daemons(store, layout, ["n0", "n1"]) == []


def test_failover_is_timed_from_the_last_etcd_restart_that_renewed_the_dead_leaders_lease() -> None:
    # No restart: from the kill.
    assert failover_time(100.0, 105.5, []) == (5.5, 0)
    # Restarts ending before the kill or after the takeover do not count.
    assert failover_time(100.0, 105.5, [99.0, 106.0]) == (5.5, 0)
    # The soak of seed 20261122: killed at 607.5, etcd back at 611.9, 614.1 and 618.4, new
    # leader at 620.9 -> 2.5 s after the last renewal, not 13.4 s.
    took, restarts = failover_time(607.5, 620.9, [611.9, 614.1, 618.4])
    assert restarts == 3 and abs(took - 2.5) < 1e-9
