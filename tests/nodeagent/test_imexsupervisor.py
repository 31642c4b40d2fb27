"""IMEX supervisor against a real etcd and real simulated daemons on loopback addresses."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from libs.gen.computedomain.state import v1 as pb
from libs.hardware.cluster import ClusterDescription
from libs.hardware.simulated import SimulatedNodeHardware
from libs.imex.config import DEFAULT_CMD_PORT, DEFAULT_SERVER_PORT, parse_imex_config, parse_nodes_config
from libs.imex.simulator import client as simclient
from libs.imex.simulator.launch import RUN_DAEMON_SCRIPT
from libs.state.membership import join_domain, leave_domain, mark_member_lost
from libs.state.store import Store
from libs.state.watch import Resync, watch_prefix
from services.nodeagent.imexsupervisor import (
    CONFIG_FILE,
    LOG_FILE,
    NODES_CONFIG_FILE,
    ImexSettings,
    ImexSupervisor,
    exit_reason,
    membership_of,
    nodes_config_peers,
    tail_lines,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

FAST = ImexSettings(
    stop_grace_s=2.0,
    restart_backoff_initial_s=0.3,
    restart_backoff_cap_s=1.0,
    stop_daemons_on_exit=True,
    sim_heartbeat_interval_s=0.5,
)


# ---------------------------------------------------------------------------- helpers


def _port_free(address: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((address, port))
        except OSError:
            return False
    return True


def free_cluster(nodes: int) -> ClusterDescription:
    """A one-rack cluster on a random 127.<block>.0.x block whose IMEX ports are free."""
    for _ in range(100):
        block = random.randint(100, 250)
        cluster = ClusterDescription(racks=1, trays_per_rack=18, address_block=block, seed=uuid.uuid4().hex)
        addresses = [cluster.node_address(0, t) for t in range(nodes)]
        if all(_port_free(a, DEFAULT_SERVER_PORT) and _port_free(a, DEFAULT_CMD_PORT) for a in addresses):
            return cluster
    raise RuntimeError("no free loopback block")


def proc_cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode().rstrip("\0").split("\0")


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


async def eventually(check: Callable[[], object], timeout_s: float = 5.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout_s} s: {what or check}")
        await asyncio.sleep(0.02)


@dataclass
class Node:
    name: str
    record: pb.Node
    supervisor: ImexSupervisor
    work_dir: Path
    task: asyncio.Task[None] | None = None

    def domain_dir(self, uid: str) -> Path:
        return self.work_dir / uid

    def nodes_config(self, uid: str) -> list[str]:
        return parse_nodes_config((self.domain_dir(uid) / NODES_CONFIG_FILE).read_text())


class Rack:
    """Supervisors of simulated nodes of one rack, all in this process, on one etcd."""

    def __init__(self, store: Store, base: Path, cluster: ClusterDescription, settings: ImexSettings) -> None:
        self.store = store
        self.base = base
        self.cluster = cluster
        self.settings = settings
        self.nodes: list[Node] = []

    def add(self, tray: int, non_fabric: bool = False, work_dir: Path | None = None) -> Node:
        sim = self.cluster.node(f"rack0-tray{tray}")
        hardware = SimulatedNodeHardware(self.cluster, sim.name, self.base / "hw" / sim.name)
        record = pb.Node(
            name=sim.name,
            ip_address=sim.address,
            clique_id="" if non_fabric else sim.clique,
            cluster_uuid="" if non_fabric else sim.cluster_uuid,
        )
        wd = work_dir or self.base / "imex" / sim.name
        node = Node(sim.name, record, ImexSupervisor(self.store, sim.name, hardware, wd, self.settings), wd)
        node.task = asyncio.create_task(node.supervisor.run())
        self.nodes.append(node)
        return node

    async def stop(self, node: Node) -> None:
        assert node.task is not None
        node.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await node.task
        node.task = None

    async def join(self, node: Node, uid: str, timeout_s: float = 10.0) -> float:
        """Join the domain like the DRA plugin does; returns seconds until this node is READY."""
        started = time.perf_counter()
        await join_domain(self.store, uid, "ns", node.record)
        node.supervisor.nudge(uid)
        assert await node.supervisor.wait_ready(uid, timeout_s), f"{node.name} not READY in {timeout_s} s"
        return time.perf_counter() - started

    async def status(self, uid: str, node: Node) -> pb.DaemonStatus | None:
        item = await self.store.get(self.store.keys.daemon(uid, node.name), pb.DaemonStatus)
        return item.value if item else None


def kill_daemons_under(directory: Path) -> None:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes()
                if str(directory).encode() in cmdline:
                    os.kill(int(entry.name), signal.SIGKILL)


@pytest.fixture
async def rack(store: Store, tmp_path: Path) -> AsyncIterator[Rack]:
    r = Rack(store, tmp_path, free_cluster(18), FAST)
    try:
        yield r
    finally:
        for node in r.nodes:
            if node.task is not None:
                await r.stop(node)
        kill_daemons_under(tmp_path)  # safety net: no daemon of this test may outlive it


class StatusRecorder:
    """Every DaemonStatus value written for one domain, in order (through a store watch)."""

    def __init__(self, store: Store, uid: str) -> None:
        self.values: list[tuple[str, pb.DaemonStatus | None]] = []
        self._task = asyncio.create_task(self._run(store, uid))

    async def _run(self, store: Store, uid: str) -> None:
        async for event in watch_prefix(store, store.keys.daemons(uid), pb.DaemonStatus):
            if isinstance(event, Resync):
                self.values.extend((i.key.rsplit("/", 1)[1], i.value) for i in event.items)
            else:
                self.values.append((event.key.rsplit("/", 1)[1], event.value))

    def of(self, node: str) -> list[pb.DaemonStatus | None]:
        return [v for n, v in self.values if n == node]

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


# ---------------------------------------------------------------------------- pure core


def _member(
    name: str, index: int, clique: str = "c.1", state: pb.MemberState = pb.MemberState.ACTIVE
) -> pb.Member:
    return pb.Member(
        domain_uid="d",
        node_name=name,
        clique_id=clique,
        index=index,
        state=state,
        ip_address=f"10.0.0.{index + 10}",
    )


def test_nodes_config_lists_active_members_of_the_clique_by_index() -> None:
    members = [
        _member("c", 2),
        _member("a", 0),
        _member("lost", -1, state=pb.MemberState.LOST),
        _member("other-clique", 1, clique="c.2"),
        _member("b", 1),
    ]
    assert nodes_config_peers(members, "c.1") == ("10.0.0.10", "10.0.0.11", "10.0.0.12")


def test_membership_lost_or_absent_member_runs_nothing() -> None:
    binding = pb.NodeBinding(node_name="a", domain_uid="d")
    lost = [(_member("a", -1, state=pb.MemberState.LOST), 5), (_member("b", 1), 6)]
    assert membership_of("a", binding, lost).desired is None
    assert membership_of("a", binding, [(_member("b", 1), 6)]).desired is None
    assert membership_of("a", None, []).domain_uid is None
    non_fabric = membership_of("a", binding, [(_member("a", -1, clique=""), 3)])
    assert non_fabric.non_fabric and non_fabric.desired is None
    active = membership_of("a", binding, [(_member("a", 0), 7), (_member("b", 1), 6)])
    assert active.desired is not None
    assert active.desired.peers == ("10.0.0.10", "10.0.0.11") and active.desired.member_revision == 7


def test_exit_reason_and_log_tail(tmp_path: Path) -> None:
    assert exit_reason(-signal.SIGKILL) == "daemon killed by SIGKILL"
    assert exit_reason(3) == "daemon exited with status 3"
    log = tmp_path / "log"
    log.write_text("".join(f"line {i}\n" for i in range(30)))
    assert tail_lines(log, 10) == [f"line {i}" for i in range(20, 30)]
    assert tail_lines(tmp_path / "missing", 10) == []


# ---------------------------------------------------------------------------- with daemons


async def test_join_starts_a_daemon_that_becomes_ready(rack: Rack) -> None:
    node = rack.add(0)
    uid = str(uuid.uuid4())
    await rack.join(node, uid)

    pid = node.supervisor.daemon_pid(uid)
    assert pid is not None and pid_alive(pid)
    config = parse_imex_config((node.domain_dir(uid) / CONFIG_FILE).read_text())
    assert config["BIND_INTERFACE_IP"] == node.record.ip_address
    assert config["SIM_DOMAIN_ID"] == uid
    assert node.nodes_config(uid) == [node.record.ip_address]
    assert (node.domain_dir(uid) / LOG_FILE).exists()
    assert node.supervisor.domain_dirs() == [node.domain_dir(uid)]

    async def status_ready() -> bool:
        s = await rack.status(uid, node)
        return s is not None and s.state == pb.DaemonState.READY

    await eventually(status_ready, what="DaemonStatus READY")
    status = await rack.status(uid, node)
    assert status is not None
    assert status.pid == pid and status.restarts == 0 and status.last_error == ""
    assert status.peers == [node.record.ip_address]
    daemon = await simclient.query_status(node.record.ip_address, DEFAULT_CMD_PORT, 2.0)
    assert daemon.ready and daemon.pid == pid and daemon.domain_id == uid


async def test_three_nodes_form_a_domain_then_one_leaves(rack: Rack) -> None:
    nodes = [rack.add(t) for t in range(3)]
    uid = str(uuid.uuid4())
    await asyncio.gather(*(rack.join(n, uid) for n in nodes))

    addresses = [n.record.ip_address for n in nodes]
    configs = [n.nodes_config(uid) for n in nodes]
    assert all(c == configs[0] for c in configs)
    assert sorted(configs[0]) == sorted(addresses) and len(configs[0]) == 3
    members, _ = await rack.store.list(rack.store.keys.members(uid), pb.Member)
    by_index = [m.value.ip_address for m in sorted(members, key=lambda m: m.value.index)]
    assert configs[0] == by_index

    async def all_ready() -> bool:
        statuses = [await rack.status(uid, n) for n in nodes]
        return all(s is not None and s.state == pb.DaemonState.READY and len(s.peers) == 3 for s in statuses)

    await eventually(all_ready, what="3 READY statuses")
    for n in nodes:
        daemon = await simclient.query_status(n.record.ip_address, DEFAULT_CMD_PORT, 2.0)
        assert daemon.ready and sorted(daemon.nodes) == sorted(addresses)

    # Node 2 leaves: the others are reconfigured in place (SIGUSR1, same pid).
    stayers, leaver = nodes[:2], nodes[2]
    pids = {n.name: n.supervisor.daemon_pid(uid) for n in nodes}
    generations = {n.name: (await rack.status(uid, n)).config_generation for n in stayers}  # type: ignore[union-attr]
    leaver_pid = pids[leaver.name]
    assert leaver_pid is not None
    await leave_domain(rack.store, uid, leaver.name)
    leaver.supervisor.nudge(uid)

    remaining = [n.record.ip_address for n in stayers]
    await eventually(
        lambda: all(sorted(n.nodes_config(uid)) == sorted(remaining) for n in stayers), what="2-line configs"
    )

    async def reconfigured() -> bool:
        for n in stayers:
            s = await rack.status(uid, n)
            if s is None or s.config_generation != generations[n.name] + 1 or len(s.peers) != 2:
                return False
            if s.state != pb.DaemonState.READY:
                return False
        return True

    await eventually(reconfigured, what="stayers reconfigured and READY")
    for n in stayers:
        assert n.supervisor.daemon_pid(uid) == pids[n.name], "membership change must not restart the daemon"
        log = (n.domain_dir(uid) / LOG_FILE).read_text()
        assert "Received SIGUSR1" in log
        daemon = await simclient.query_status(n.record.ip_address, DEFAULT_CMD_PORT, 2.0)
        assert daemon.ready and sorted(daemon.nodes) == sorted(remaining)

    # The leaver's daemon is gone, its directory removed and its status deleted.
    await eventually(lambda: not pid_alive(leaver_pid), what="leaver's daemon gone")
    await eventually(lambda: not leaver.domain_dir(uid).exists(), what="leaver's dir removed")
    assert await rack.status(uid, leaver) is None
    assert leaver.supervisor.domain_dirs() == []


async def test_joins_in_other_cliques_leave_the_daemon_alone(rack: Rack) -> None:
    """A 256-node domain spans 15 cliques: a member of one clique must not be reconfigured, nor even
    reconciled, for joins in the others (that was O(N^2) work per node)."""
    node = rack.add(0)
    uid = str(uuid.uuid4())
    await rack.join(node, uid)
    reconciles = 0
    real_reconcile = node.supervisor._reconcile

    async def counting_reconcile() -> None:
        nonlocal reconciles
        reconciles += 1
        await real_reconcile()

    node.supervisor._reconcile = counting_reconcile  # type: ignore[method-assign]
    config_before = node.nodes_config(uid)
    status_before = await rack.status(uid, node)
    assert status_before is not None

    def outsider(i: int, clique: str) -> pb.Node:
        return pb.Node(name=f"far-{i}", clique_id=clique, ip_address=f"127.1.2.{i + 1}")

    others = [outsider(i, "other-cluster.1") for i in range(6)]
    await asyncio.gather(*(join_domain(rack.store, uid, "ns", o) for o in others))
    await leave_domain(rack.store, uid, others[0].name)
    await asyncio.sleep(0.5)  # let every member event reach the supervisor
    assert reconciles == 0, "members of another clique woke this node's reconciler"
    assert node.nodes_config(uid) == config_before
    status_after = await rack.status(uid, node)
    assert status_after is not None and status_after.config_generation == status_before.config_generation

    # A peer joining this node's own clique does reconfigure it.
    peer = rack.add(1)
    await rack.join(peer, uid)
    await eventually(lambda: len(node.nodes_config(uid)) == 2, what="peer in the nodes config")
    assert reconciles >= 1


async def test_killed_daemon_is_restarted_and_the_outage_is_visible(rack: Rack) -> None:
    node = rack.add(0)
    uid = str(uuid.uuid4())
    recorder = StatusRecorder(rack.store, uid)
    try:
        await rack.join(node, uid)
        await eventually(lambda: any(s and s.state == pb.DaemonState.READY for s in recorder.of(node.name)))
        first_pid = node.supervisor.daemon_pid(uid)
        assert first_pid is not None
        os.kill(first_pid, signal.SIGKILL)

        def back_ready() -> bool:
            statuses = recorder.of(node.name)
            return (
                bool(statuses)
                and statuses[-1] is not None
                and statuses[-1].state == pb.DaemonState.READY
                and statuses[-1].restarts == 1
            )

        await eventually(back_ready, timeout_s=10, what="READY again after the restart")
        down = [s for s in recorder.of(node.name) if s is not None and s.state == pb.DaemonState.NOT_READY]
        assert down, "the outage must be visible in the store"
        assert down[0].last_error == "daemon killed by SIGKILL"
        assert down[0].pid == 0
        assert any("IMEX" in line for line in down[0].last_log_lines), down[0].last_log_lines
        final = recorder.of(node.name)[-1]
        assert final is not None
        assert final.pid != first_pid and pid_alive(final.pid) and final.last_error == ""
        assert node.supervisor.daemon_pid(uid) == final.pid
    finally:
        await recorder.close()


async def test_start_failure_is_reported_with_the_daemons_own_words(rack: Rack) -> None:
    node = rack.add(0)
    uid = str(uuid.uuid4())
    # Someone else holds this node's IMEX port: the daemon cannot bind and exits.
    blocker = socket.socket()
    blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    blocker.bind((node.record.ip_address, DEFAULT_SERVER_PORT))
    blocker.listen()
    try:
        await join_domain(rack.store, uid, "ns", node.record)
        node.supervisor.nudge(uid)
        assert not await node.supervisor.wait_ready(uid, 0.5)

        async def failed() -> bool:
            s = await rack.status(uid, node)
            return s is not None and s.state == pb.DaemonState.FAILED

        await eventually(failed, timeout_s=10, what="FAILED after repeated start failures")
        status = await rack.status(uid, node)
        assert status is not None
        assert status.last_error == "daemon exited with status 1"
        assert any("failed to bind" in line for line in status.last_log_lines), status.last_log_lines
        assert status.restarts >= 2
    finally:
        blocker.close()
    # Once the port is free the next retry succeeds.
    assert await node.supervisor.wait_ready(uid, 10.0)


async def test_non_fabric_node_runs_no_daemon(rack: Rack) -> None:
    node = rack.add(0, non_fabric=True)
    uid = str(uuid.uuid4())
    result = await join_domain(rack.store, uid, "ns", node.record)
    assert result.member.index == -1
    assert await node.supervisor.wait_ready(uid, 5.0)
    await asyncio.sleep(0.3)
    assert node.supervisor.domain_dirs() == []
    assert node.supervisor.daemon_pid(uid) is None
    assert await rack.status(uid, node) is None


async def test_lost_member_stops_its_daemon_and_peers_drop_it(rack: Rack) -> None:
    a, b = rack.add(0), rack.add(1)
    uid = str(uuid.uuid4())
    await asyncio.gather(rack.join(a, uid), rack.join(b, uid))
    await eventually(lambda: len(a.nodes_config(uid)) == 2 and len(b.nodes_config(uid)) == 2)
    b_pid = b.supervisor.daemon_pid(uid)
    assert b_pid is not None
    # b's lease expired while it was partitioned: the controller marks it LOST.
    assert await mark_member_lost(rack.store, uid, b.name)
    await eventually(lambda: a.nodes_config(uid) == [a.record.ip_address], what="a drops b")
    await eventually(lambda: not pid_alive(b_pid), what="b stops its daemon")
    await eventually(lambda: not b.domain_dir(uid).exists())
    assert await rack.status(uid, b) is None
    assert await a.supervisor.wait_ready(uid, 5.0)


async def test_restarted_supervisor_adopts_its_daemon_and_cleans_up_leftovers(rack: Rack) -> None:
    rack.settings = replace(FAST, stop_daemons_on_exit=False)
    node = rack.add(0)
    uid = str(uuid.uuid4())
    await rack.join(node, uid)
    pid = node.supervisor.daemon_pid(uid)
    assert pid is not None

    # A leftover domain directory with a live daemon, for a domain this node is no longer in.
    stale_uid = str(uuid.uuid4())
    other = rack.add(1, work_dir=node.work_dir.parent / "scratch")
    await rack.join(other, stale_uid)
    stale_pid = other.supervisor.daemon_pid(stale_uid)
    assert stale_pid is not None
    await rack.stop(other)  # leaves the daemon running
    await leave_domain(rack.store, stale_uid, other.name)
    (node.work_dir / stale_uid).mkdir()
    for name in (CONFIG_FILE, NODES_CONFIG_FILE, "daemon.pid"):
        (node.work_dir / stale_uid / name).write_bytes((other.domain_dir(stale_uid) / name).read_bytes())

    # The agent restarts (its tasks end without stopping the daemons) ...
    await rack.stop(node)
    assert pid_alive(pid) and pid_alive(stale_pid)
    again = rack.add(0, work_dir=node.work_dir)
    # ... and the new incarnation keeps the running daemon and stops the stray one.
    assert await again.supervisor.wait_ready(uid, 5.0)
    assert again.supervisor.daemon_pid(uid) == pid
    await eventually(lambda: not pid_alive(stale_pid), what="stray daemon stopped")
    await eventually(lambda: not (node.work_dir / stale_uid).exists(), what="stray dir removed")
    # Supervision works on the adopted process: a leave stops it.
    await leave_domain(rack.store, uid, again.name)
    again.supervisor.nudge(uid)
    await eventually(lambda: not pid_alive(pid), what="adopted daemon stopped on leave")
    await eventually(lambda: again.supervisor.domain_dirs() == [])


async def test_hung_daemon_is_killed_and_restarted(rack: Rack) -> None:
    rack.settings = replace(FAST, unresponsive_kill_s=0.6, poll_interval_ready_s=0.1, query_timeout_s=0.2)
    node = rack.add(0)
    uid = str(uuid.uuid4())
    await rack.join(node, uid)
    pid = node.supervisor.daemon_pid(uid)
    assert pid is not None
    await simclient.inject_fault(node.record.ip_address, DEFAULT_CMD_PORT, "hang")
    await eventually(lambda: not pid_alive(pid), what="hung daemon killed")
    await eventually(
        lambda: node.supervisor.daemon_pid(uid) not in (None, pid), timeout_s=5, what="restarted"
    )
    assert await node.supervisor.wait_ready(uid, 5.0)

    async def restarted_status() -> bool:
        s = await rack.status(uid, node)
        return s is not None and s.state == pb.DaemonState.READY and s.restarts == 1

    await eventually(restarted_status)


@pytest.mark.slow
async def test_eighteen_nodes_form_a_domain(rack: Rack) -> None:
    """All 18 trays of a rack join one domain at once, three times over.

    Prints the formation time (SPEC §9 targets p50 <= 1 s for the whole system on an idle 2-core
    machine; here 18 agents' supervisors, their joins and 18 daemons share this process and
    machine, so the bound asserted is only a sanity bound).
    """
    rack.settings = replace(FAST, sim_heartbeat_interval_s=None)
    nodes = [rack.add(t) for t in range(18)]
    await asyncio.sleep(0.2)  # supervisors up and watching, as on a running cluster
    timings: list[float] = []
    for _round in range(3):
        uid = str(uuid.uuid4())
        started = time.perf_counter()
        per_node = await asyncio.gather(*(rack.join(n, uid) for n in nodes))

        async def formed(uid: str = uid) -> bool:
            # Every daemon READY on the full, identical 18-line nodes config (invariant 4).
            statuses = await asyncio.gather(*(rack.status(uid, n) for n in nodes))
            ready = [s for s in statuses if s is not None and s.state == pb.DaemonState.READY]
            peer_lists = {tuple(s.peers) for s in ready}
            return len(ready) == 18 and len(peer_lists) == 1 and len(peer_lists.pop()) == 18

        await eventually(formed, timeout_s=15, what="18 READY daemons on one nodes config")
        total = time.perf_counter() - started
        timings.append(total)
        configs = [n.nodes_config(uid) for n in nodes]
        assert all(c == configs[0] for c in configs) and len(configs[0]) == 18
        print(
            f"18-node formation: domain formed after {total * 1000:.0f} ms; join->local READY "
            f"p50 {statistics.median(per_node) * 1000:.0f} ms, max {max(per_node) * 1000:.0f} ms"
        )
        await asyncio.gather(*(leave_domain(rack.store, uid, n.name) for n in nodes))
        for n in nodes:
            n.supervisor.nudge(uid)
        await eventually(lambda: all(not n.supervisor.domain_dirs() for n in nodes), timeout_s=10)
    print(f"18-node formation p50 over {len(timings)} rounds: {statistics.median(timings) * 1000:.0f} ms")
    assert statistics.median(timings) < 10.0


async def test_nvidia_backend_runs_nvidia_imex_and_polls_with_the_ctl(rack: Rack, tmp_path: Path) -> None:
    """The real-hardware path: `nvidia-imex -c <cfg>` and `nvidia-imex-ctl -q -c <cfg>`.

    Stand-ins with those names run the simulator, so the commands, arguments and the parsing of
    the ctl's answer are the ones used with the real binaries.
    """
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "ctl-calls"
    imex = bin_dir / "nvidia-imex"
    imex.write_text(f'#!/bin/sh\nexec {sys.executable} -I -S {RUN_DAEMON_SCRIPT} "$@"\n')
    ctl = bin_dir / "nvidia-imex-ctl"
    ctl.write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\ncd {REPO_ROOT} && exec {sys.executable} -m libs.imex.simulator.ctl "$@"\n'
    )
    imex.chmod(0o755)
    ctl.chmod(0o755)
    rack.settings = replace(
        FAST,
        backend="nvidia",
        nvidia_imex_binary=str(imex),
        nvidia_imex_ctl_binary=str(ctl),
        poll_interval_starting_s=0.05,
    )
    node = rack.add(0)
    uid = str(uuid.uuid4())
    await rack.join(node, uid, timeout_s=15.0)
    pid = node.supervisor.daemon_pid(uid)
    assert pid is not None
    assert proc_cmdline(pid)[-2:] == ["-c", str(node.domain_dir(uid) / CONFIG_FILE)]
    assert f"-q -c {node.domain_dir(uid) / CONFIG_FILE}" in calls.read_text().splitlines()
