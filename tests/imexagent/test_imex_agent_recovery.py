"""The IMEX agent with daemons that wait for recovery, nodes whose driver is too old, and a
silent daemon: what it reports and how it stops a daemon (real etcd, real simulated daemons)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path

from libs.contract.names import REASON_DRIVER_TOO_OLD, REASON_WAITING_FOR_RECOVERY
from libs.gen.computedomain.state import v1 as pb
from libs.state.store import Store
from tests.imexagent.imex_rack import (
    FAST,
    Node,
    Rack,
    free_cluster,
    kill_daemons_under,
)
from tests.polling import eventually
from tools.launch import pid_alive
from tools.sim.imex import client as simclient
from tools.sim.imex.recovery import PERSIST_FILE

UID = "cd-0001"
# The daemons outlive their agent (as after an agent crash): a node is killed by killing both.
DETACHING = replace(FAST, stop_daemons_on_exit=False)


async def kill_node(rack: Rack, node: Node) -> None:
    """The whole node dies: its agent, then its daemon (SIGKILL, no BYE, no clean stop)."""
    status = await rack.status(UID, node)
    await rack.stop(node)
    assert status is not None and status.pid > 0
    os.kill(status.pid, signal.SIGKILL)
    await eventually(lambda: not pid_alive(status.pid), "daemon gone")


async def status_with(rack: Rack, node: Node, **expect: object) -> pb.DaemonStatus:
    async def check() -> pb.DaemonStatus | None:
        status = await rack.status(UID, node)
        if status is None or any(getattr(status, k) != v for k, v in expect.items()):
            return None
        return status

    return await eventually(check, f"status of {node.name} with {expect}", 15)


async def test_a_node_back_after_a_kill_waits_for_its_importers_and_says_so(
    store: Store, tmp_path: Path
) -> None:
    rack = Rack(store, tmp_path, free_cluster(3), DETACHING)
    a, b, c = rack.node(0), rack.node(1), rack.node(2)
    try:
        for index, node in enumerate((a, b, c)):
            rack.start(node)
            await rack.join(UID, node, index)
        for node, others in ((a, [b.name, c.name]), (b, [a.name, c.name]), (c, [a.name, b.name])):
            await rack.ready_status(UID, node, connected_nodes=others)
        port = FAST.cmd_port
        await simclient.import_memory(b.sim.address, port, "job", 0, 1.0)  # B and C use A's memory
        await simclient.import_memory(c.sim.address, port, "job", 0, 1.0)
        await simclient.import_memory(a.sim.address, port, "job", 1, 1.0)  # and A uses B's
        await eventually(
            lambda: (a.dir(UID) / PERSIST_FILE).read_text().count(":") == 2, "A's importers recorded"
        )

        await kill_node(rack, a)
        await kill_node(rack, b)
        rack.start(a)  # A comes back; B (an importer of its memory) does not, yet
        waiting = await status_with(rack, a, reason=REASON_WAITING_FOR_RECOVERY)
        assert waiting.state != pb.DaemonState.READY
        assert f"members not connected now: {b.name} (slot 1)" in waiting.last_error
        assert c.name not in waiting.last_error.partition("not connected now")[2]
        for _ in range(10):  # no time limit: the wait and its reason stay while B is away
            await asyncio.sleep(0.2)
            now = await rack.status(UID, a)
            assert now is not None and now.reason == REASON_WAITING_FOR_RECOVERY
            assert now.state != pb.DaemonState.READY and now.pid == waiting.pid

        rack.start(b)  # B's new instance reconnects: A has recovered (and B, whose file lists A)
        ready_a = await rack.ready_status(UID, a, pid=waiting.pid, connected_nodes=[b.name, c.name])
        assert ready_a.reason == "" and ready_a.last_error == ""
        ready_b = await rack.ready_status(UID, b, connected_nodes=[a.name, c.name])
        assert ready_b.reason == ""
        log = (a.dir(UID) / "nvidia-imex.log").read_text()
        assert "WAITING_FOR_RECOVERY" in log and "Recovery complete" in log
    finally:
        for node in rack.nodes:
            await rack.stop(node)
        kill_daemons_under(tmp_path)


async def test_a_node_with_an_older_driver_starts_no_daemon_and_names_the_version_needed(
    store: Store, tmp_path: Path
) -> None:
    cluster = replace(free_cluster(1), node_driver_versions=(("rack0-tray0", "570.133.20"),))
    rack = Rack(store, tmp_path, cluster)
    a = rack.node(0)
    try:
        rack.start(a)
        await rack.join(UID, a, 0)
        status = await status_with(rack, a, reason=REASON_DRIVER_TOO_OLD)
        assert status.state == pb.DaemonState.FAILED and status.pid == 0
        assert "570.133.20" in status.last_error and "570.158.01" in status.last_error
        await asyncio.sleep(1.0)  # nothing is retried: the driver does not change under a node
        again = await rack.status(UID, a)
        assert again is not None and again.restarts == 0 and again.pid == 0
        assert not (a.dir(UID) / "nvidia-imex.log").exists(), "no daemon was started"
    finally:
        await rack.stop(a)
        kill_daemons_under(tmp_path)


_SILENT_DAEMON = """
import signal, sys, time
def stop(signum, frame):
    open(sys.argv[1], "a").write("SIGTERM\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
while True:
    time.sleep(1)
"""


async def test_a_silent_daemon_is_stopped_with_sigterm_before_any_sigkill(
    store: Store, tmp_path: Path
) -> None:
    """Killed outright, a daemon that still handles signals would leave an unclean stop, and its
    successor would wait for recovery: SIGTERM comes first."""
    marker = tmp_path / "terminated"
    silent = replace(
        FAST,
        daemon_command=(sys.executable, "-c", _SILENT_DAEMON, str(marker)),
        unresponsive_kill_s=0.5,
        query_timeout_s=0.2,
    )
    rack = Rack(store, tmp_path, free_cluster(1), silent)
    a = rack.node(0)
    try:
        rack.start(a)
        await rack.join(UID, a, 0)
        await eventually(marker.exists, "the silent daemon got SIGTERM", 15)
        await status_with(rack, a, restarts=1)
        assert marker.read_text().startswith("SIGTERM")
    finally:
        await rack.stop(a)
        kill_daemons_under(tmp_path)
