"""The IMEX agent against a real etcd and real simulated daemons on loopback addresses.

What a job on the node would notice: the daemon it uses keeps its pid (and instance) through
peers joining, peers being lost and the agent itself restarting; it is replaced only when it
died or its own identity changed, and gone once the node left the domain.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import BinaryIO

import aiohttp
import pytest

from libs.gen.computedomain.state import v1 as pb
from libs.imex import slots
from libs.imex.config import SIM_HOSTS_FILE
from libs.state.config import EtcdConfig
from libs.state.store import Store
from libs.state.watch import Resync, watch_prefix
from services.imexagent.daemon_supervisor import ImexSupervisor
from services.imexagent.domain_dir import HOSTS_FILE, NODES_CONFIG_FILE
from services.imexagent.main import run_imex_agent
from services.imexagent.settings import ImexAgentSettings
from tests.imexagent.imex_rack import FAST, Rack, free_cluster, kill_daemons_under
from tests.polling import eventually
from tools import launch
from tools.launch import pid_alive
from tools.net_ports import free_port
from tools.sim.hardware.simulated import SimulatedNodeHardware, prepare_node_dirs
from tools.sim.imex import client as simclient

UID = "cd-0001"
REPO = Path(__file__).resolve().parents[2]


async def _http_ok(http: aiohttp.ClientSession, url: str) -> bool:
    async with http.get(url) as response:
        return response.status == 200


def _append(path: Path) -> BinaryIO:
    return open(path, "ab")  # the agents' output, for a failing test's report


@pytest.fixture
async def rack(store: Store, tmp_path: Path) -> AsyncIterator[Rack]:
    r = Rack(store, tmp_path, free_cluster(4))
    try:
        yield r
    finally:
        for node in r.nodes:
            await r.stop(node)
        kill_daemons_under(tmp_path)


def hosts_of(path: Path) -> dict[str, str]:
    return slots.parse_hosts((path / HOSTS_FILE).read_text())


async def test_join_then_a_peer_join_rewrites_the_hosts_and_signals_the_same_daemon(rack: Rack) -> None:
    a, b = rack.node(0), rack.node(1)
    rack.start(a)
    rack.start(b)
    await rack.join(UID, a, 0)
    first = await rack.ready_status(UID, a, node_id=0)
    clique = a.sim.clique
    names = slots.slot_names(UID, clique)
    nodes_config = (a.dir(UID) / NODES_CONFIG_FILE).read_text()
    assert nodes_config == slots.render_nodes_config_slots(UID, clique), "18 slot names"
    assert len(nodes_config.splitlines()) == slots.MAX_SLOTS
    assert f"# {SIM_HOSTS_FILE}={a.dir(UID) / HOSTS_FILE}" in (a.dir(UID) / "config.cfg").read_text()
    hosts = hosts_of(a.dir(UID))
    assert hosts[names[0]] == a.sim.address
    assert {hosts[n] for n in names[1:]} == {slots.PLACEHOLDER_ADDRESS}
    assert list(first.peers) == [a.sim.address] + [slots.PLACEHOLDER_ADDRESS] * (slots.MAX_SLOTS - 1)
    assert first.pid > 0 and first.instance and first.connected_nodes == []
    nodes_config_stat = os.stat(a.dir(UID) / NODES_CONFIG_FILE)

    await rack.join(UID, b, 1)
    # Both daemons see each other connected; A's is the same process, told to re-resolve.
    after = await rack.ready_status(UID, a, connected_nodes=[b.name])
    await rack.ready_status(UID, b, connected_nodes=[a.name], node_id=1)
    assert after.pid == first.pid and after.instance == first.instance
    assert after.config_generation >= 1
    assert hosts_of(a.dir(UID))[names[1]] == b.sim.address
    assert hosts_of(b.dir(UID)) == hosts_of(a.dir(UID))
    runner = a.supervisor.runner(UID) if a.supervisor else None
    assert runner is not None
    # B's daemon can connect to A's before A's is told to re-resolve: the signal may come later.
    await eventually(lambda: runner.sigusr1_sent >= 1, "SIGUSR1 sent to A's daemon", 10.0)
    await eventually(
        lambda: "Received SIGUSR1" in (a.dir(UID) / "nvidia-imex.log").read_text(),
        "A's daemon to log the SIGUSR1",
        10.0,
    )
    unchanged = os.stat(a.dir(UID) / NODES_CONFIG_FILE)
    assert (unchanged.st_ino, unchanged.st_mtime_ns) == (
        nodes_config_stat.st_ino,
        nodes_config_stat.st_mtime_ns,
    )
    assert after.restarts == 0


async def test_a_member_recording_a_plaintext_mesh_starts_its_daemon_without_the_domain_record(
    rack: Rack,
) -> None:
    """The join copied the decided mode into the member record: the agent needs nothing else
    (no read of a domain record carrying a large domain's status on the formation's path)."""
    a = rack.node(0)
    rack.start(a)
    await rack.join(UID, a, 0, mesh_mode=pb.MeshMode.PLAINTEXT, with_domain=False)
    status = await rack.ready_status(UID, a, node_id=0)
    assert status.pid > 0
    assert await rack.store.get(rack.store.keys.domain(UID), pb.ComputeDomain) is None


async def test_a_lost_member_keeps_its_daemon_and_its_slot(rack: Rack) -> None:
    a, b = rack.node(0), rack.node(1)
    rack.start(a)
    rack.start(b)
    await rack.join(UID, a, 0)
    await rack.join(UID, b, 1)
    a_before = await rack.ready_status(UID, a, connected_nodes=[b.name])
    b_before = await rack.ready_status(UID, b, connected_nodes=[a.name])

    await rack.set_state(UID, b, pb.MemberState.LOST)
    assert a.supervisor is not None and b.supervisor is not None
    b_runner = b.supervisor.runner(UID)
    assert b_runner is not None
    await eventually(lambda: b_runner.desired.lost, "B's supervisor acted on its loss")
    a_supervisor = a.supervisor

    def a_saw_b_lost() -> bool:
        member = a_supervisor.member(b.name)
        return member is not None and member.state == pb.MemberState.LOST

    await eventually(a_saw_b_lost, "A's supervisor saw B's loss")
    # Both reconcilers have acted on the loss: same daemons, B's slot still B's address.
    assert a.supervisor.daemon_pid(UID) == a_before.pid and b.supervisor.daemon_pid(UID) == b_before.pid
    assert hosts_of(a.dir(UID))[slots.slot_name(UID, a.sim.clique, 1)] == b.sim.address
    # The controller needs B's connection to A reported while B is LOST.
    await rack.ready_status(UID, a, connected_nodes=[b.name], pid=a_before.pid)

    await rack.set_state(UID, b, pb.MemberState.ACTIVE)  # the node record is back
    await rack.ready_status(UID, b, pid=b_before.pid, connected_nodes=[a.name])


async def test_a_released_member_stops_its_daemon_and_removes_its_directory(rack: Rack) -> None:
    a, b = rack.node(0), rack.node(1)
    rack.start(a)
    rack.start(b)
    await rack.join(UID, a, 0)
    await rack.join(UID, b, 1)
    b_status = await rack.ready_status(UID, b, connected_nodes=[a.name])
    a_status = await rack.ready_status(UID, a, connected_nodes=[b.name])

    await rack.release(UID, b)
    await eventually(lambda: not pid_alive(b_status.pid), "B's daemon stopped")
    await eventually(lambda: not b.dir(UID).exists(), "B's directory removed")
    assert await eventually(lambda: _absent(rack, b), "B's status deleted")
    # A empties B's slot and keeps running.
    await eventually(
        lambda: hosts_of(a.dir(UID))[slots.slot_name(UID, a.sim.clique, 1)] == slots.PLACEHOLDER_ADDRESS,
        "B's slot in A's nodes file to hold the placeholder",
    )
    await rack.ready_status(UID, a, connected_nodes=[], pid=a_status.pid)


async def _absent(rack: Rack, node: object) -> bool:
    return await rack.status(UID, node) is None  # type: ignore[arg-type]


async def test_a_killed_daemon_is_restarted_with_backoff_and_counted(rack: Rack) -> None:
    a = rack.node(0)
    rack.start(a)
    await rack.join(UID, a, 0)
    first = await rack.ready_status(UID, a)
    os.kill(first.pid, signal.SIGKILL)
    again = await rack.ready_status(UID, a, restarts=1)
    assert again.pid != first.pid and again.instance != first.instance
    os.kill(again.pid, signal.SIGKILL)
    third = await rack.ready_status(UID, a, restarts=2)
    assert third.pid not in (first.pid, again.pid)
    runner = a.supervisor.runner(UID) if a.supervisor else None
    assert runner is not None and runner.lifecycle.consecutive_failures == 0


async def test_a_new_address_of_its_own_restarts_the_daemon(rack: Rack) -> None:
    a = rack.node(0)
    rack.start(a)
    await rack.join(UID, a, 0)
    first = await rack.ready_status(UID, a)
    other = rack.cluster.node_address(0, 3)
    await rack.join(UID, a, 0, address=other)
    moved = await rack.ready_status(
        UID, a, peers=[other] + [slots.PLACEHOLDER_ADDRESS] * (slots.MAX_SLOTS - 1)
    )
    assert moved.pid != first.pid and not pid_alive(first.pid)
    assert moved.restarts == 1


# ---------------------------------------------------------------------------- the program


def agent_settings(rack: Rack, etcd_config: EtcdConfig, tray: int) -> ImexAgentSettings:
    cluster_file = rack.base / "cluster.json"
    if not cluster_file.exists():
        rack.cluster.save(cluster_file)
    name = rack.cluster.node_name(0, tray)
    prepare_node_dirs(rack.cluster, name, rack.base / "hw")
    return ImexAgentSettings(
        node_name=name,
        etcd_endpoint=etcd_config.endpoint,
        etcd_prefix=etcd_config.prefix,
        hardware="simulated",
        sim_cluster=str(cluster_file),
        sim_state_dir=str(rack.base / "hw"),
        imex_work_dir=str(rack.base / "imex" / name),
        lease_ttl_s=2,
        health_host="127.0.0.1",
        health_port=0,
    )


async def test_a_restarted_agent_adopts_the_running_daemon(rack: Rack, etcd_config: EtcdConfig) -> None:
    a = rack.node(0)
    settings = agent_settings(rack, etcd_config, 0)
    imex = replace(FAST, stop_daemons_on_exit=False)
    stop = asyncio.Event()
    agent = asyncio.create_task(run_imex_agent(settings, stop, imex=imex, handle_signals=False))
    node_key = rack.store.keys.node(a.name)
    await eventually(lambda: rack.store.get(node_key, pb.Node), "node record on the lease")
    await rack.join(UID, a, 0)
    first = await rack.ready_status(UID, a)

    agent.cancel()  # as abrupt as it gets in-process: no orderly stop
    await asyncio.wait([agent])
    assert pid_alive(first.pid), "the daemon outlives its agent"

    stop = asyncio.Event()
    settings = replace(settings, health_port=free_port())
    agent = asyncio.create_task(run_imex_agent(settings, stop, imex=imex, handle_signals=False))
    try:
        # Written by the new agent: the same process and instance.
        adopted = await rack.ready_status(UID, a, newer_than=first, pid=first.pid)
        assert adopted.instance == first.instance and adopted.restarts == 0
        status = await simclient.query_status(a.sim.address, FAST.cmd_port, 2.0)
        assert status.pid == first.pid and status.instance == first.instance
        base = f"http://127.0.0.1:{settings.health_port}"
        async with aiohttp.ClientSession() as http:
            await eventually(lambda: _http_ok(http, f"{base}/readyz"), "ready once registered")
            async with http.get(f"{base}/healthz") as response:
                assert response.status == 200
            async with http.get(f"{base}/metrics") as response:
                metrics = await response.text()
        assert f'cd_imex_daemon_ready{{cd_uid="{UID}"}} 1.0' in metrics
        assert f'cd_imex_daemon_restarts{{cd_uid="{UID}"}} 0.0' in metrics
    finally:
        stop.set()
        await asyncio.wait([agent])
    assert pid_alive(first.pid), "a plain stop leaves the daemon for the next agent"


async def test_a_sigkilled_agent_process_is_replaced_and_the_daemon_kept(
    rack: Rack, etcd_config: EtcdConfig
) -> None:
    a = rack.node(0)
    settings = agent_settings(rack, etcd_config, 0)
    argv = launch.service_argv(
        "imex-agent",
        [
            f"--node-name={settings.node_name}",
            f"--etcd-endpoint={settings.etcd_endpoint}",
            f"--etcd-prefix={settings.etcd_prefix}",
            "--hardware=simulated",
            f"--sim-cluster={settings.sim_cluster}",
            f"--sim-state-dir={settings.sim_state_dir}",
            f"--imex-work-dir={settings.imex_work_dir}",
            "--lease-ttl-s=2",
            "--health-host=127.0.0.1",
            "--health-port=0",
            "--log-format=json",
        ],
    )
    repo = REPO
    log = _append(rack.base / "agent.log")
    first_agent = await asyncio.create_subprocess_exec(*argv, cwd=repo, stdout=log, stderr=log)
    second_agent = None
    try:
        await rack.join(UID, a, 0)
        first = await rack.ready_status(UID, a)
        first_agent.send_signal(signal.SIGKILL)
        await first_agent.wait()
        assert pid_alive(first.pid)
        second_agent = await asyncio.create_subprocess_exec(
            *argv, "--stop-daemons-on-exit=true", cwd=repo, stdout=log, stderr=log
        )
        adopted = await rack.ready_status(UID, a, newer_than=first, pid=first.pid)
        assert adopted.instance == first.instance and adopted.restarts == 0
        second_agent.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(second_agent.wait(), 20) == 0
        assert not pid_alive(first.pid), "--stop-daemons-on-exit stops it"
    finally:
        for p in (first_agent, second_agent):
            if p is not None and p.returncode is None:
                p.kill()
                await p.wait()
        log.close()


async def test_a_hung_daemon_is_killed_and_replaced(store: Store, tmp_path: Path) -> None:
    rack = Rack(store, tmp_path, free_cluster(1), replace(FAST, unresponsive_kill_s=1.0, query_timeout_s=0.2))
    a = rack.node(0)
    try:
        rack.start(a)
        await rack.join(UID, a, 0)
        first = await rack.ready_status(UID, a)
        await simclient.inject_fault(a.sim.address, FAST.cmd_port, "hang")
        again = await rack.ready_status(UID, a, restarts=1)
        assert again.pid != first.pid and not pid_alive(first.pid)
    finally:
        await rack.stop(a)
        kill_daemons_under(tmp_path)


async def test_a_daemon_that_cannot_start_is_failed_with_its_own_words(store: Store, tmp_path: Path) -> None:
    """A daemon that exits at once: after `failed_after` tries the status says FAILED and shows
    the daemon's last log lines."""
    broken = replace(
        FAST,
        daemon_command=(
            sys.executable,
            "-c",
            "import sys; print('bind failed: no such address'); sys.exit(1)",
        ),
        failed_after=2,
        restart_backoff_initial_s=0.05,
        # The agent keeps retrying a FAILED daemon; a cap well above the daemon's life leaves
        # seconds between tries in which no daemon runs, so the check below cannot miss them.
        restart_backoff_cap_s=5.0,
    )
    rack = Rack(store, tmp_path, free_cluster(1), broken)
    a = rack.node(0)
    try:
        rack.start(a)
        await rack.join(UID, a, 0)

        async def failed() -> pb.DaemonStatus | None:
            # FAILED between two tries: the status a user reads while no daemon runs (during a
            # try it shows that try's pid).
            status = await rack.status(UID, a)
            if status is None or status.state != pb.DaemonState.FAILED or status.pid != 0:
                return None
            return status

        status = await eventually(failed, "FAILED status with no daemon running")
        assert "exited with status 1" in status.last_error
        assert any("bind failed" in line for line in status.last_log_lines)
        assert status.restarts >= 1
    finally:
        await rack.stop(a)
        kill_daemons_under(tmp_path)


async def test_a_peer_joining_while_the_hosts_file_is_written_still_reaches_it(
    rack: Rack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A membership change that lands during a hosts write is written next, not taken as written."""
    import threading

    from services.imexagent.domain_dir import DomainDir

    a, b, c = rack.node(0), rack.node(1), rack.node(2)
    for node in (a, b, c):
        rack.start(node)
    await rack.join(UID, a, 0)
    await rack.ready_status(UID, a, node_id=0)
    writing, release = threading.Event(), threading.Event()
    real_write = DomainDir.write_hosts

    def slow_write(self: DomainDir, text: str, *, in_place: bool = False) -> None:
        if self.path.parent == a.work_dir and not release.is_set():
            writing.set()
            release.wait(10)  # hold the first rewrite of A's hosts until C has joined
        real_write(self, text, in_place=in_place)

    monkeypatch.setattr(DomainDir, "write_hosts", slow_write)
    await rack.join(UID, b, 1)
    assert await asyncio.to_thread(writing.wait, 10), "A never rewrote its hosts for B"
    await rack.join(UID, c, 2)
    await eventually(
        lambda: a.supervisor is not None and a.supervisor.member(c.name) is not None,
        "A's supervisor to know C",
    )
    release.set()
    await rack.ready_status(UID, a, connected_nodes=[b.name, c.name])
    names = slots.slot_names(UID, a.sim.clique)
    hosts = hosts_of(a.dir(UID))
    assert (hosts[names[1]], hosts[names[2]]) == (b.sim.address, c.sim.address)


async def test_a_members_watch_lagging_behind_the_binding_does_not_hold_the_daemon(rack: Rack) -> None:
    """The join writes the binding and the member record together, but the members watch can
    lag (etcd's slow watchers; a scale host's shared feed): the agent reads its own record
    instead of waiting, and the watch, once it catches up, changes nothing."""
    caught_up = asyncio.Event()

    def lagging(
        store: Store, prefix: str, cls: type, *args: object, **kwargs: object
    ) -> AsyncIterator[object]:
        async def stream() -> AsyncIterator[object]:
            if prefix == store.keys.members(UID):
                yield Resync([], 0)  # a view from before the join
                await caught_up.wait()
            async for item in watch_prefix(store, prefix, cls, *args, **kwargs):  # type: ignore[arg-type]
                yield item

        return stream()

    a = rack.node(0)
    hardware = SimulatedNodeHardware(rack.cluster, a.name, rack.base / "hw" / a.name)
    a.supervisor = ImexSupervisor(rack.store, a.name, hardware, a.work_dir, rack.settings, watch=lagging)
    a.task = asyncio.create_task(a.supervisor.run())
    await rack.join(UID, a, 0, mesh_mode=pb.MeshMode.PLAINTEXT)
    first = await rack.ready_status(UID, a, node_id=0)
    assert not caught_up.is_set() and first.pid > 0
    caught_up.set()
    await eventually(
        lambda: a.supervisor is not None and a.supervisor.member(a.name) is not None,
        "A's restarted supervisor to know A",
    )
    await asyncio.sleep(0.5)
    again = await rack.ready_status(UID, a, node_id=0)
    assert (again.pid, again.instance, again.restarts) == (first.pid, first.instance, 0)
