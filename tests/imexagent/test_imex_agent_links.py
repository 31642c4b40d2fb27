"""The IMEX agent while a member's IMEX links are cut (every process lives): it renders its grace
time, reports the peer its daemon lost as disconnected (what the controller's PeerUnreachable
reads), keeps the daemon, and reports the link connected again once the cut is over."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from libs.imex.config import DEFAULT_CMD_PORT
from libs.imex.simulator import client as simclient
from libs.state.store import Store
from services.imexagent.domaindir import CONFIG_FILE
from services.imexagent.settings import DEFAULT_DISCONNECTED_GRACE_S
from tests.imexagent.imex_rack import FAST, Rack, free_cluster, kill_daemons_under

UID = "cd-0002"


@pytest.fixture
async def rack(store: Store, tmp_path: Path) -> AsyncIterator[Rack]:
    r = Rack(store, tmp_path, free_cluster(2), replace(FAST, sim_heartbeat_interval_s=0.2))
    try:
        yield r
    finally:
        for node in r.nodes:
            await r.stop(node)
        kill_daemons_under(tmp_path)


async def test_a_cut_peer_is_reported_disconnected_then_connected_with_the_same_daemons(rack: Rack) -> None:
    a, b = rack.node(0), rack.node(1)
    rack.start(a)
    rack.start(b)
    await rack.join(UID, a, 0)
    await rack.join(UID, b, 1)
    a_before = await rack.ready_status(UID, a, connected_nodes=[b.name])
    b_before = await rack.ready_status(UID, b, connected_nodes=[a.name])
    config = (a.dir(UID) / CONFIG_FILE).read_text()
    assert f"IMEX_NODE_DISCONNECTED_GRACE_TIME={DEFAULT_DISCONNECTED_GRACE_S}\n" in config

    await simclient.inject_fault(b.sim.address, DEFAULT_CMD_PORT, simclient.CUT_LINKS, seconds=4.0)
    # Both ends report the other lost (not "never connected"), and the daemons stay READY.
    await rack.ready_status(UID, a, connected_nodes=[], disconnected_nodes=[b.name], pid=a_before.pid)
    await rack.ready_status(UID, b, connected_nodes=[], disconnected_nodes=[a.name], pid=b_before.pid)
    # The cut ends by itself; the same daemons are connected again.
    await rack.ready_status(UID, a, connected_nodes=[b.name], disconnected_nodes=[], pid=a_before.pid)
    after = await rack.ready_status(UID, b, connected_nodes=[a.name], disconnected_nodes=[], pid=b_before.pid)
    assert after.instance == b_before.instance
