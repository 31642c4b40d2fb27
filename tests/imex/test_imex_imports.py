"""Memory imports through the simulated daemons: valid while the exporter is the same instance."""

from __future__ import annotations

import json
import signal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.imex.config import DEFAULT_CMD_PORT
from tests.imex.simdomain import SimCluster, SimNode, start
from tests.imex.test_imex_daemon import ctl
from tools.sim.imex import client
from tools.sim.imex.imports import ImportTable

PORT = DEFAULT_CMD_PORT


async def imports_of(node: SimNode) -> dict[int, client.Import]:
    return {i.node_id: i for i in await client.list_imports(node.address, PORT, 1.0)}


async def import_all(importer: SimNode, job: str, exporters: list[int]) -> None:
    for node_id in exporters:
        await client.import_memory(importer.address, PORT, job, node_id, 1.0)


async def test_imports_survive_sigusr1_and_a_link_drop_on_either_side(cluster: SimCluster):
    n0, n1, n2 = cluster.domain(3)
    await start([n0, n1, n2])
    instance = await client.import_memory(n0.address, PORT, "job-a", 1, 1.0)
    assert instance == (await n1.status()).instance
    made = await ctl(n0, "--import", "job-a", "2")
    assert (made.returncode, made.stdout.strip()) == (0, (await n2.status()).instance)

    for node in (n0, n1):  # both ends restart their connections
        node.signal(signal.SIGUSR1)
    await n0.wait_log("Connection established to node 1 with address", count=2)
    await n1.wait_log("Connection established to node 0 with address", count=2)
    await n0.wait_connected([1, 2])

    await client.inject_fault(n1.address, PORT, "drop-peer", 0)  # the exporter cuts the link
    await n0.wait_until(lambda st: st.connections[1] != "CONNECTED", "link to node 1 cut")
    await client.inject_fault(n1.address, PORT, "heal")
    await n0.wait_connected([1, 2])

    found = await imports_of(n0)
    assert [(i.job, i.valid, i.reason) for i in found.values()] == [("job-a", True, "")] * 2
    listing = json.loads((await ctl(n0, "--imports", "-j")).stdout)
    assert [(e["job"], e["node_id"], e["valid"]) for e in listing] == [("job-a", 1, True), ("job-a", 2, True)]


async def test_a_restarted_exporter_invalidates_its_imports(cluster: SimCluster):
    n0, n1, n2 = cluster.domain(3)
    await start([n0, n1, n2])
    await import_all(n0, "job-a", [1, 2])
    old = (await n1.status()).instance

    await client.inject_fault(n1.address, PORT, "crash")  # no BYE: nobody knows yet
    assert n1.wait_exit() == 1
    await n0.wait_until(lambda st: st.connections[1] == "DISCONNECTED", "node 1 gone")
    assert (await imports_of(n0))[1].valid
    with pytest.raises(client.CommandRejected, match="not connected"):
        await client.import_memory(n0.address, PORT, "job-b", 1, 1.0)

    n1.spawn()  # a new instance in the same slot
    new = (await n0.wait_connected([1])).peer_instances[1]
    assert new != old
    found = await imports_of(n0)
    assert not found[1].valid and "restarted" in found[1].reason and old in found[1].reason
    assert found[2].valid  # node 2 is the same instance
    table = (await ctl(n0, "--imports")).stdout
    assert "NO" in table and "restarted" in table


async def test_a_stopped_exporter_says_bye_and_its_imports_are_invalid(cluster: SimCluster):
    n0, n1, n2 = cluster.domain(3)
    await start([n0, n1, n2])
    await import_all(n0, "job-a", [1, 2])
    await import_all(n1, "job-a", [0, 2])
    n2.signal(signal.SIGTERM)
    assert n2.wait_exit() == 0
    for importer in (n0, n1):
        await importer.wait_until(lambda st: st.connections[2] == "DISCONNECTED", "node 2 gone")
        found = await imports_of(importer)
        assert not found[2].valid and "shut down" in found[2].reason
    assert (await imports_of(n0))[1].valid

    removed = await ctl(n0, "--unimport", "job-a")
    assert removed.stdout == "2\n"
    assert await client.list_imports(n0.address, PORT, 1.0) == []


async def test_an_import_must_name_a_connected_peer_of_the_map(cluster: SimCluster):
    (n0, _n1) = cluster.domain(2)
    n0.spawn()
    await n0.wait_until(lambda st: st.ready, "READY")
    for node_id, why in ((0, "not a peer"), (18, "not a peer"), (1, "not connected")):
        with pytest.raises(client.CommandRejected, match=why):
            await client.import_memory(n0.address, PORT, "job", node_id, 1.0)
    assert (await ctl(n0, "--import", "job", "one")).returncode == 2


# --------------------------------------------------------------------------- the pure table

events = st.lists(
    st.tuples(
        st.sampled_from(["add", "seen", "bye"]), st.integers(0, 2), st.sampled_from(["i1", "i2", "i3"])
    ),
    max_size=30,
)


@given(events)
def test_an_import_is_valid_until_a_handshake_shows_another_instance_or_its_instance_says_bye(steps):
    table = ImportTable()
    model: dict[int, tuple[str, bool]] = {}  # exporter node -> (instance imported from, valid)
    for kind, node, instance in steps:
        if kind == "add":
            table.add("job", node, instance)
            model[node] = (instance, True)
        elif node in model:
            imported, valid = model[node]
            ends = imported != instance if kind == "seen" else imported == instance
            model[node] = (imported, valid and not ends)
        if kind == "seen":
            table.exporter_seen(node, instance)
        elif kind == "bye":
            table.exporter_gone(node, instance)
        assert {e.node_id: (e.instance, e.valid) for e in table.listing()} == model
        assert all(e.reason for e in table.listing() if not e.valid)
    assert table.remove_job("job") == len(model) and table.listing() == []
