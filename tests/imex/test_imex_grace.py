"""Lost links and IMEX_NODE_DISCONNECTED_GRACE_TIME (NVIDIA's IMEX guide, "Connections, Quorum, and
Clean up"): a daemon keeps its references to a peer it cannot reach; a reconnect to the same
instance keeps every import; with a grace time, a peer disconnected longer than that is cleaned up.
The partition is the simulator's `cut-links` fault: the node's peer links fall silent both ways
while every process lives."""

from __future__ import annotations

import asyncio

import pytest

from libs.imex.config import DEFAULT_CMD_PORT
from tests.imex.simdomain import SimCluster, SimNode, start
from tools.sim.imex import client
from tools.sim.imex.grace import DisconnectClock
from tools.sim.imex.imports import ImportTable

PORT = DEFAULT_CMD_PORT
HEARTBEAT_S = 0.2  # a silent link is dead after 3 heartbeats


async def job_imports_everywhere(nodes: list[SimNode]) -> dict[int, str]:
    """Every node imports job-a from every other; returns each node's instance."""
    for importer in nodes:
        for node_id in range(len(nodes)):
            if importer is not nodes[node_id]:
                await client.import_memory(importer.address, PORT, "job-a", node_id, 1.0)
    return {i: (await n.status()).instance for i, n in enumerate(nodes)}


async def imports(node: SimNode) -> list[client.Import]:
    return await client.list_imports(node.address, PORT, 1.0)


async def cut_and_wait_seen(nodes: list[SimNode], cut: int, seconds: float) -> None:
    """Cut node `cut`'s links for `seconds`; return once every peer reports it not connected."""
    await client.inject_fault(nodes[cut].address, PORT, client.CUT_LINKS, seconds=seconds)
    for i, node in enumerate(nodes):
        if i != cut:
            await node.wait_until(lambda st: st.connections[cut] != "CONNECTED", f"node {cut} lost", 5.0)


@pytest.mark.parametrize("grace_s", [-1, 4], ids=["default-wait-forever", "grace-longer-than-cut"])
async def test_imports_survive_a_cut_shorter_than_the_grace_time(cluster: SimCluster, grace_s: int):
    nodes = cluster.domain(3, heartbeat_s=HEARTBEAT_S, grace_s=grace_s)
    await start(nodes)
    instances = await job_imports_everywhere(nodes)
    await cut_and_wait_seen(nodes, 1, seconds=2.0)
    # The cut node lost every peer, its peers lost only it.
    isolated = await nodes[1].wait_until(
        lambda st: all(st.connections[i] != "CONNECTED" for i in (0, 2)), "node 1 isolated", 5.0
    )
    assert isolated.state == "READY"  # -q is local: a partitioned daemon is still READY
    assert (await nodes[0].status()).connections[2] == "CONNECTED"
    for node in nodes:  # the cut is over: every link comes back, to the same instances
        await node.wait_connected(range(3), timeout_s=10.0)
    for i, node in enumerate(nodes):
        assert (await node.status()).instance == instances[i]
        found = await imports(node)
        assert len(found) == 2 and all(imp.valid for imp in found), found
    assert "cleaning up" not in "".join(n.log_text() for n in nodes)


async def test_imports_die_after_a_cut_longer_than_the_grace_time(cluster: SimCluster):
    nodes = cluster.domain(3, heartbeat_s=HEARTBEAT_S, grace_s=1)
    await start(nodes)
    instances = await job_imports_everywhere(nodes)
    await cut_and_wait_seen(nodes, 1, seconds=3.5)
    await nodes[0].wait_log("Node 1 disconnected for 1 s (IMEX_NODE_DISCONNECTED_GRACE_TIME)")
    for node in nodes:
        await node.wait_connected(range(3), timeout_s=10.0)
    # Both sides cleaned up what crossed the cut; nothing else was touched, and no one restarted.
    for i, node in enumerate(nodes):
        assert (await node.status()).instance == instances[i]
        found = {imp.node_id: imp for imp in await imports(node)}
        crossed = {0: [1], 1: [0, 2], 2: [1]}[i]
        for node_id, imp in found.items():
            assert imp.valid == (node_id not in crossed), (i, imp)
            if node_id in crossed:
                assert "IMEX_NODE_DISCONNECTED_GRACE_TIME" in imp.reason
    # A reconnect does not bring the cleaned-up references back, but new imports work.
    await client.import_memory(nodes[0].address, PORT, "job-b", 1, 1.0)


async def test_a_cut_node_keeps_answering_its_command_service_and_dials_nothing(cluster: SimCluster):
    nodes = cluster.domain(2, heartbeat_s=HEARTBEAT_S)
    await start(nodes)
    await cut_and_wait_seen(nodes, 0, seconds=30.0)
    await asyncio.sleep(1.0)  # several reconnect attempts of both sides
    status = await nodes[0].status()
    assert status.connections[1] != "CONNECTED" and "timed out" in status.reasons[1], status.reasons
    assert (await nodes[1].status()).connections[0] != "CONNECTED"
    assert "Fault injected: IMEX network links cut for 30 s" in nodes[0].log_text()


def test_the_grace_clock_counts_from_the_loss_and_restarts_on_reconnect():
    clock = DisconnectClock(5)
    assert clock.observe([1, 2], [1, 2], now=0.0) == []
    assert clock.observe([2], [1, 2], now=1.0) == []  # node 1 lost at 1.0
    assert clock.next_deadline() == 6.0
    assert clock.observe([2], [1, 2], now=5.9) == []
    assert clock.observe([2], [1, 2], now=6.0) == [1]
    assert clock.observe([2], [1, 2], now=60.0) == []  # cleaned up once
    assert clock.next_deadline() is None
    assert clock.observe([1, 2], [1, 2], now=61.0) == []  # back: a new loss counts afresh
    assert clock.observe([2], [1, 2], now=62.0) == []
    assert clock.observe([2], [1, 2], now=67.0) == [1]
    forever = DisconnectClock(-1)
    assert forever.observe([], [1], now=0.0) == [] and forever.observe([], [1], now=1e9) == []
    assert forever.next_deadline() is None
    assert DisconnectClock(0).observe([], [1], now=3.0) == [1]  # 0: at once


def test_a_grace_clean_up_invalidates_only_that_exporters_imports():
    table = ImportTable()
    table.add("job-a", 1, "i1")
    table.add("job-a", 2, "i2")
    hit = table.exporter_disconnected(1, 30)
    assert [(e.node_id, e.valid) for e in hit] == [(1, False)]
    assert [(e.node_id, e.valid) for e in table.listing()] == [(1, False), (2, True)]
    assert table.exporter_disconnected(1, 30) == []
