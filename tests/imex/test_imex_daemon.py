"""The simulated IMEX daemon as real processes talking TCP on real loopback addresses: start-up,
links, name resolution, handshake checks, SIGUSR1 and faults."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from libs.imex import slots
from libs.imex.config import DEFAULT_CMD_PORT, DEFAULT_SERVER_PORT
from libs.imex.hosts_ns import private_hosts_argv
from tests.imex.simdomain import (
    REPO_ROOT,
    SimCluster,
    SimNode,
    free_loopback_addresses,
    slot_addresses,
    start,
)
from tools.sim.imex import client
from tools.sim.imex import protocol as proto

READY = "READY"


async def ctl(
    node: SimNode | None, *args: str, inside: bool = False, hosts: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the ctl tool as a process, as a user or script would (``-c <config>`` unless None);
    ``inside``: in a mount namespace with the node's hosts file (or `hosts`) over /etc/hosts,
    where the daemon's names resolve (the IMEX agent runs every ctl call in the daemon's)."""
    target = [] if node is None else ["-c", str(node.config_path)]
    argv = [sys.executable, "-m", "tools.sim.imex.ctl", *target, *args]
    if inside:
        assert node is not None
        argv = private_hosts_argv(argv, str(hosts or node.hosts_path))
    proc = await asyncio.create_subprocess_exec(
        *argv,
        cwd=REPO_ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(20):
        out, err = await proc.communicate()
    assert proc.returncode is not None
    return subprocess.CompletedProcess(args, proc.returncode, out.decode(), err.decode())


async def test_members_identify_their_slots_connect_and_ctl_shows_this_daemons_view(cluster: SimCluster):
    nodes = cluster.domain(3)
    nodes[0].spawn(via_module=True)  # the documented command line works too
    await start(nodes[1:], members=3)
    await nodes[0].wait_connected(range(3))
    for i, node in enumerate(nodes):
        assert (
            f"Identified this node as ID {i}, using bind address of '{node.slot_name(i)}'" in node.log_text()
        )

    assert (await ctl(nodes[1], "-q")).stdout == "READY\n"
    direct = await ctl(None, "-i", nodes[2].address, str(DEFAULT_CMD_PORT), "-q")
    assert (direct.returncode, direct.stdout) == (0, "READY\n")

    full = await ctl(nodes[0], "-N", "-j", "-H", inside=True)
    assert full.returncode == 0, full.stderr
    report = json.loads(full.stdout)
    assert report["status"] == "UP"  # empty slots (the placeholder) do not count
    assert report["nodeId"] == 0
    links = report["nodes"]["0"]["connections"]
    assert [links[str(i)]["host"] for i in range(3)] == [n.address for n in nodes]
    assert [links[str(i)]["status"] for i in range(3)] == ["CONNECTED"] * 3
    assert links["5"] == {
        "host": slots.PLACEHOLDER_ADDRESS,
        "status": "NEVER_CONNECTED",
        "changed": True,
        "hostName": nodes[0].slot_name(5),
        "reason": links["5"]["reason"],
    }
    assert len(report["nodes"]) == slots.MAX_SLOTS
    table = (await ctl(nodes[0], "-N", inside=True)).stdout
    assert "Domain State: UP" in table and "C   C   C   N" in table
    log = nodes[0].log_text()
    assert f"Connection established to node 1 with address {nodes[0].slot_name(1)}" in log


async def test_a_ctl_where_the_slot_names_do_not_resolve_sees_no_peer(cluster: SimCluster):
    """The ctl resolves the node names itself, through the /etc/hosts where it runs (as the real
    nvidia-imex-ctl must): outside the daemon's mount namespace no node of the map is reached
    and none shows connected, though every link is up. -q, local only, still answers."""
    nodes = cluster.domain(3)
    await start(nodes, members=3)
    await nodes[0].wait_connected(range(3))

    outside = await ctl(nodes[0], "-N", "-j", "-H")
    assert outside.returncode == 0, outside.stderr
    report = json.loads(outside.stdout)
    assert all(node["connections"] == {} for node in report["nodes"].values())
    assert {node["status"] for node in report["nodes"].values()} == {"UNAVAILABLE"}
    assert {node["host"] for node in report["nodes"].values()} == {""}
    assert "nodeId" not in report and report["status"] == "DEGRADED"
    table = (await ctl(nodes[0], "-N")).stdout
    assert "Domain State: DEGRADED" in table and " C " not in table
    assert (await ctl(nodes[0], "-q")).stdout == "READY\n"

    inside = json.loads((await ctl(nodes[0], "-N", "-j", inside=True)).stdout)
    links = inside["nodes"]["0"]["connections"]
    assert [links[str(i)]["status"] for i in range(3)] == ["CONNECTED"] * 3


async def test_a_ctl_whose_hosts_map_the_own_slot_elsewhere_cannot_place_the_daemon(cluster: SimCluster):
    """A hosts file that resolves the names, but not the daemon's own one to its address: the
    ctl reached a daemon it cannot find in the map, so it shows no row's connections."""
    nodes = cluster.domain(2)
    await start(nodes, members=2)
    await nodes[0].wait_connected([1])
    other = cluster.root / "other-hosts"
    other.write_text(
        slots.render_hosts(slot_addresses([nodes[1].address] * 2), "cd-uid-1", nodes[0].clique_id)
    )
    report = json.loads((await ctl(nodes[0], "-N", "-j", inside=True, hosts=other)).stdout)
    assert all(node["connections"] == {} for node in report["nodes"].values())
    assert report["nodes"]["1"]["host"] == nodes[1].address


async def test_ready_alone_with_no_peer_up(cluster: SimCluster):
    n0, n1, _ = cluster.domain(3)
    n0.spawn()
    status = await n0.wait_until(lambda st: st.ready, "READY")
    assert (status.node_id, status.connections[1], status.connections[2]) == (
        0,
        "NEVER_CONNECTED",
        "NEVER_CONNECTED",
    )
    quick = await ctl(n0, "-q")
    assert (quick.returncode, quick.stdout) == (0, "READY\n")
    n1.spawn()  # a late peer is reached by the reconnect loop
    await n0.wait_connected([1])


async def test_start_refused_without_an_own_entry_or_with_a_repeated_one(cluster: SimCluster):
    (n0,) = cluster.domain(1)
    other = free_loopback_addresses(2)[1]
    n0.write_slots([other])  # no slot resolves to BIND_INTERFACE_IP
    n0.spawn()
    assert n0.wait_exit() == 1
    assert "[ERROR]" in n0.log_text()
    assert "No matching network interface found for any IP addresses in the node configuration file" in (
        n0.log_text()
    )

    repeated = cluster.node(n0.address, "cd-uid-2")
    repeated.write_config([n0.address], names=["s0.x.invalid", "s1.x.invalid"])
    repeated.nodes_path.write_text("s0.x.invalid\nS0.X.invalid\n")
    repeated.spawn()
    assert repeated.wait_exit() == 1
    assert "listed twice" in repeated.log_text()

    missing = cluster.node(n0.address, "cd-uid-3")
    missing.write_config([n0.address])
    missing.nodes_path.unlink()
    missing.spawn()
    assert missing.wait_exit() == 1
    assert "Failed to read node configuration file" in missing.log_text()


async def test_nodes_config_is_not_reread_on_sigusr1(cluster: SimCluster):
    a_addr, b_addr, c_addr = free_loopback_addresses(3)
    names = ["node-a.test.invalid", "node-b.test.invalid"]
    a, b = cluster.node(a_addr), cluster.node(b_addr)
    hosts = f"{a_addr} {names[0]}\n{b_addr} {names[1]}\n{c_addr} node-c.test.invalid\n"
    for node in (a, b):
        node.write_config([], names=names)
        node.write_hosts(hosts)
    await start([a, b])
    dialled_c: list[str] = []
    server = await asyncio.start_server(
        lambda r, w: (dialled_c.append("x"), w.close()), c_addr, DEFAULT_SERVER_PORT
    )
    async with server:
        a.nodes_path.write_text("\n".join([*names, "node-c.test.invalid"]) + "\n")
        a.signal(signal.SIGUSR1)
        # SIGUSR1 re-dials every outgoing link at once: once b is reconnected, c would have been
        # dialled too had the list been re-read.
        await a.wait_log(f"Connection established to node 1 with address {names[1]}", count=2)
        await a.wait_connected([1])
        status = await a.status()
        assert status.nodes == names and len(status.connections) == 2
        assert dialled_c == []


@pytest.mark.parametrize("via_sigusr1", [True, False], ids=["sigusr1", "reconnect-loop"])
async def test_a_readdressed_slot_is_reached(cluster: SimCluster, via_sigusr1: bool):
    # Slot 1's member dies and a new member takes slot 1 on another address. With SIGUSR1 the
    # survivor re-resolves at once (its backoff is long here); without it the reconnect loop
    # re-resolves at its next attempt.
    backoff = 5.0 if via_sigusr1 else 0.1
    a_addr, b_addr, new_addr = free_loopback_addresses(3)
    a = cluster.node(a_addr, reconnect_initial_s=backoff, reconnect_max_s=backoff)
    b, new_b = cluster.node(b_addr), cluster.node(new_addr)
    for node in (a, b):
        node.write_config([a_addr, b_addr])
    new_b.write_config([a_addr, new_addr])
    b.spawn()  # b first: a's first dial must find it (a's backoff may be long)
    await b.wait_until(lambda st: st.ready, "READY")
    await start([a], members=2)
    b.kill()
    await a.wait_until(lambda st: st.connections[1] != "CONNECTED", "link to node 1 down")
    new_b.spawn()
    await new_b.wait_until(lambda st: st.ready, "READY")  # a refuses it until slot 1 says new_addr
    began = time.monotonic()
    a.write_slots([a_addr, new_addr])
    if via_sigusr1:
        a.signal(signal.SIGUSR1)
    status = await a.wait_until(
        lambda st: (st.connections[1], st.addresses[1]) == ("CONNECTED", new_addr), "link to the new node 1"
    )
    if via_sigusr1:
        assert time.monotonic() - began < backoff * 0.9  # not the reconnect loop
    assert status.peer_instances[1] != ""
    await new_b.wait_connected([0, 1])  # a accepts it: its source address is what slot 1 resolves to


async def test_sigusr1_is_throttled_to_one_per_5_seconds_by_default(cluster: SimCluster):
    (n0,) = cluster.domain(1, sigusr1_min_interval_s=None)  # the default
    n0.spawn()
    await n0.wait_until(lambda st: st.ready, "READY")
    n0.signal(signal.SIGUSR1)
    await n0.wait_log("Received SIGUSR1: re-resolving node names and restarting all peer connections")
    n0.signal(signal.SIGUSR1)
    log = await n0.wait_log("Received SIGUSR1 within 5 s of the last one, ignored")
    assert log.count("Received SIGUSR1: re-resolving") == 1


async def test_daemons_of_different_maps_refuse_each_other(cluster: SimCluster):
    # B's domain maps slot 0 to B; A's domain (another uid, so other slot names) maps its slot 1
    # to B's address, as after an address is reused by a different ComputeDomain (#1447).
    a_addr, b_addr = free_loopback_addresses(2)
    b = cluster.node(b_addr, "domain-b")
    b.write_config([b_addr])
    a = cluster.node(a_addr, "domain-a")
    a.write_config([a_addr, b_addr])
    a.spawn()
    b.spawn()
    status = await a.wait_until(lambda st: st.connections[1] == "NODE_MAP_MISMATCH", "map mismatch")
    assert "node map mismatch" in status.reasons[1]
    await b.wait_log(f"Refused connection from {a_addr}: node map mismatch")
    table = (await ctl(a, "-N", inside=True)).stdout
    assert "!M!" in table and "Domain State: DEGRADED" in table


async def test_hello_checks_node_id_and_source_address(cluster: SimCluster):
    n0, n1 = cluster.domain(2)
    n0.spawn()
    status = await n0.wait_until(lambda st: st.ready, "READY")
    stranger = free_loopback_addresses(3)[2]

    async def hello(source: str, node_id: str, digest: str = status.map_digest) -> tuple[str, dict[str, str]]:
        reader, writer = await asyncio.open_connection(
            n0.address, DEFAULT_SERVER_PORT, local_addr=(source, 0)
        )
        fields = {"domain": "cd-uid-1", "node_id": node_id, "instance": "x", "addr": source, "map": digest}
        writer.write(proto.encode(proto.HELLO, fields))
        reply = proto.decode(await asyncio.wait_for(reader.readline(), 2))
        writer.close()
        return reply

    assert (await hello(stranger, "1"))[1]["code"] == "address-mismatch"  # slot 1 is n1's address
    assert (await hello(n1.address, "0"))[1]["code"] == "invalid-node-id"  # n0's own ID
    assert (await hello(n1.address, "18"))[1]["code"] == "invalid-node-id"
    assert (await hello(n1.address, "1", "0" * 16))[1]["code"] == "node-map-mismatch"
    verb, fields = await hello(n1.address, "1")
    assert (verb, fields["node_id"], fields["instance"]) == ("WELCOME", "0", status.instance)


async def test_sigterm_says_bye_and_crash_does_not(cluster: SimCluster):
    n0, n1, n2 = cluster.domain(3)
    await start([n0, n1, n2])
    n1.signal(signal.SIGTERM)
    assert n1.wait_exit() == 0
    await n0.wait_until(lambda st: st.connections[1] == "DISCONNECTED", "node 1 gone")
    assert "peer is shutting down" in n0.log_text()
    assert "Received SIGTERM, shutting down" in n1.log_text()

    await client.inject_fault(n2.address, DEFAULT_CMD_PORT, "crash")
    assert n2.wait_exit() == 1
    await n0.wait_until(lambda st: st.connections[2] == "DISCONNECTED", "node 2 gone")
    n2.spawn()  # what the supervisor does after a crash
    await n0.wait_connected([2])


async def test_hang_fault_makes_queries_time_out_and_peers_drop_it(cluster: SimCluster):
    n0, n1 = cluster.domain(2, heartbeat_s=0.2)
    await start([n0, n1])
    assert (await ctl(n1, "--inject", "hang")).stdout == "OK\n"
    quick = await ctl(n1, "-q", "--timeout", "0.5")
    assert (quick.returncode, quick.stdout) == (1, "UNAVAILABLE\n")
    assert "no reply" in quick.stderr
    await n0.wait_until(lambda st: st.connections[1] == "DISCONNECTED", "heartbeat timeout", 3.0)
    assert "heartbeat timeout" in n0.log_text()
    n1.signal(signal.SIGTERM)  # a hung daemon does not even handle SIGTERM
    with pytest.raises(subprocess.TimeoutExpired):
        n1.wait_exit(timeout=0.3)


async def test_drop_peer_until_heal_or_sigusr1(cluster: SimCluster):
    n0, n1, n2 = cluster.domain(3)
    await start([n0, n1, n2])
    await client.inject_fault(n0.address, DEFAULT_CMD_PORT, "drop-peer", 1)
    status = await n0.wait_until(lambda st: st.connections[1] == "DISCONNECTED", "node 1 dropped")
    assert status.dropped == (1,) and status.connections[2] == "CONNECTED"
    refused = await n1.wait_until(lambda st: "dropped" in st.reasons.get(0, ""), "n0 refusing n1")
    assert refused.connections[0] != "CONNECTED"
    await client.inject_fault(n0.address, DEFAULT_CMD_PORT, "heal")
    await n0.wait_connected([1])
    await n1.wait_connected([0])

    assert (await ctl(n0, "--inject", "drop-peer", n2.address)).returncode == 0  # by address
    await n0.wait_until(lambda st: st.dropped == (2,), "node 2 dropped")
    n0.signal(signal.SIGUSR1)  # also heals
    await n0.wait_connected([1, 2])


async def test_ctl_without_a_daemon_or_config(cluster: SimCluster):
    (n0,) = cluster.domain(1)
    quick = await ctl(n0, "-q", "--timeout", "0.5")
    assert (quick.returncode, quick.stdout) == (1, "UNAVAILABLE\n")
    assert (await ctl(n0, "-N", "-j", "--timeout", "0.5")).returncode == 1
    missing = await ctl(None, "-c", str(cluster.root / "nope.cfg"), "-q")
    assert missing.returncode == 255 and "Failed to read configuration file" in missing.stderr


def test_eighteen_daemons_form_a_domain_quickly(cluster: SimCluster):
    nodes = cluster.domain(18)
    began = time.monotonic()
    for node in nodes:
        node.spawn()
    elapsed = asyncio.run(_wait_all_connected(nodes, began, deadline_s=30.0))
    print(f"\n18-daemon domain: spawn -> fully connected in {elapsed * 1000:.0f} ms")


async def _wait_all_connected(nodes: list[SimNode], began: float, deadline_s: float) -> float:
    async def connected(node: SimNode) -> bool:
        try:
            status = await node.status(0.5)
        except client.DaemonUnavailable:
            return False
        return list(status.connections.values()) == ["CONNECTED"] * len(nodes)

    pending = list(nodes)
    while pending and time.monotonic() - began < deadline_s:
        done = await asyncio.gather(*(connected(node) for node in pending))
        pending = [node for node, ok in zip(pending, done, strict=True) if not ok]
        if pending:
            await asyncio.sleep(0.01)
    assert not pending, f"not fully connected after {deadline_s} s: {[n.address for n in pending]}"
    return time.monotonic() - began
