"""The IMEX agent while a member's IMEX links are cut (every process lives): it renders its grace
time, reports the peer its daemon lost as disconnected (what the controller's PeerUnreachable
reads), keeps the daemon, and reports the link connected again once the cut is over. Imports
across the cut survive a cut shorter than the rendered grace time and are cleaned up after a
longer one."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

from libs.gen.computedomain.state import v1 as pb
from libs.imex.config import DEFAULT_CMD_PORT
from libs.state.store import Store
from services.imexagent.domain_dir import CONFIG_FILE
from services.imexagent.settings import DEFAULT_DISCONNECTED_GRACE_S
from tests.imexagent.imex_rack import FAST, Node, Rack, free_cluster, kill_daemons_under
from tools.sim.imex import client as simclient

UID = "cd-0002"


@asynccontextmanager
async def two_members(
    store: Store, tmp_path: Path, grace_s: int
) -> AsyncIterator[tuple[Rack, Node, Node, pb.DaemonStatus]]:
    """Members a (slot 0) and b (slot 1), connected; a's job imported memory from b."""
    settings = replace(FAST, sim_heartbeat_interval_s=0.2, disconnected_grace_s=grace_s)
    rack = Rack(store, tmp_path, free_cluster(2), settings)
    try:
        a, b = rack.node(0), rack.node(1)
        rack.start(a)
        rack.start(b)
        await rack.join(UID, a, 0)
        await rack.join(UID, b, 1)
        a_before = await rack.ready_status(UID, a, connected_nodes=[b.name])
        await rack.ready_status(UID, b, connected_nodes=[a.name])
        rendered = (a.dir(UID) / CONFIG_FILE).read_text()
        assert f"IMEX_NODE_DISCONNECTED_GRACE_TIME={grace_s}\n" in rendered
        await simclient.import_memory(a.sim.address, DEFAULT_CMD_PORT, "job", 1, timeout_s=2.0)
        yield rack, a, b, a_before
    finally:
        for node in rack.nodes:
            await rack.stop(node)
        kill_daemons_under(tmp_path)


async def cut_and_heal(rack: Rack, a: Node, b: Node, a_before: pb.DaemonStatus, seconds: float) -> None:
    """Cut b's links; a reports b lost, then connected again, with the same daemon."""
    await simclient.inject_fault(b.sim.address, DEFAULT_CMD_PORT, simclient.CUT_LINKS, seconds=seconds)
    await rack.ready_status(UID, a, connected_nodes=[], disconnected_nodes=[b.name], pid=a_before.pid)
    await rack.ready_status(UID, a, connected_nodes=[b.name], disconnected_nodes=[], pid=a_before.pid)


async def imported_from_b(a: Node) -> simclient.Import:
    (imported,) = await simclient.list_imports(a.sim.address, DEFAULT_CMD_PORT, timeout_s=2.0)
    return imported


async def test_a_cut_peer_is_reported_disconnected_then_connected_with_the_same_daemons(
    store: Store, tmp_path: Path
) -> None:
    async with two_members(store, tmp_path, DEFAULT_DISCONNECTED_GRACE_S) as (rack, a, b, a_before):
        b_before = await rack.ready_status(UID, b)
        await simclient.inject_fault(b.sim.address, DEFAULT_CMD_PORT, simclient.CUT_LINKS, seconds=4.0)
        # Both ends report the other lost (not "never connected"), and the daemons stay READY.
        await rack.ready_status(UID, a, connected_nodes=[], disconnected_nodes=[b.name], pid=a_before.pid)
        await rack.ready_status(UID, b, connected_nodes=[], disconnected_nodes=[a.name], pid=b_before.pid)
        # The cut ends by itself; the same daemons are connected again.
        await rack.ready_status(UID, a, connected_nodes=[b.name], disconnected_nodes=[], pid=a_before.pid)
        after = await rack.ready_status(UID, b, connected_nodes=[a.name], disconnected_nodes=[])
        assert (after.pid, after.instance) == (b_before.pid, b_before.instance)
        # Shorter than the rendered grace time: the import made before the cut is still valid.
        assert (await imported_from_b(a)).valid


async def test_a_cut_longer_than_the_rendered_grace_time_cleans_up_the_imports(
    store: Store, tmp_path: Path
) -> None:
    async with two_members(store, tmp_path, 1) as (rack, a, b, a_before):
        await cut_and_heal(rack, a, b, a_before, seconds=3.0)
        imported = await imported_from_b(a)
        assert not imported.valid and "IMEX_NODE_DISCONNECTED_GRACE_TIME" in imported.reason, imported
