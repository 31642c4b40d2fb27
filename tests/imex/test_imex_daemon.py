"""The simulated IMEX daemon as real processes talking TCP on real loopback addresses."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from libs.imex.config import DEFAULT_CMD_PORT
from libs.imex.simulator import client
from tests.imex.simdomain import REPO_ROOT, SimCluster, SimNode, free_loopback_addresses

READY = "READY"
WAITING = "WAITING_FOR_PEERS"


async def ctl(node: SimNode | Path | None, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the ctl tool as a process, as a user or script would (``-c <config>`` unless None)."""
    target = [] if node is None else ["-c", str(node.config_path if isinstance(node, SimNode) else node)]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "libs.imex.simulator.ctl",
        *target,
        *args,
        cwd=REPO_ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(20):
        out, err = await proc.communicate()
    assert proc.returncode is not None
    return subprocess.CompletedProcess(args, proc.returncode, out.decode(), err.decode())


async def start(nodes: list[SimNode]) -> None:
    for node in nodes:
        node.spawn()
    for node in nodes:
        await node.wait_state(READY)


async def test_three_daemons_form_a_ready_domain_and_ctl_reports_it(cluster: SimCluster):
    nodes = cluster.domain(3)
    nodes[0].spawn(via_module=True)  # the documented command line works too
    for node in nodes[1:]:
        node.spawn()
    for node in nodes:
        await node.wait_state(READY)

    quick = await ctl(nodes[1], "-q")
    assert (quick.returncode, quick.stdout) == (0, "READY\n")
    direct = await ctl(None, "-i", nodes[2].address, str(DEFAULT_CMD_PORT), "-q")
    assert (direct.returncode, direct.stdout) == (0, "READY\n")

    full = await ctl(nodes[0], "-N", "-j", "-H")
    assert full.returncode == 0, full.stderr
    report = json.loads(full.stdout)
    assert report["status"] == "UP"
    assert [report["nodes"][str(i)]["host"] for i in range(3)] == [n.address for n in nodes]
    for entry in report["nodes"].values():
        assert entry["status"] == READY
        assert entry["hostName"] == f"node-{entry['host']}"
        assert [c["status"] for c in entry["connections"].values()] == ["CONNECTED"] * 3

    log = nodes[0].log_text()
    assert f"Connection established to node 1 with ip address {nodes[1].address}" in log
    assert "-> READY" in log


async def test_peer_of_another_domain_is_refused_and_logged(cluster: SimCluster):
    # B forms its own one-node domain; A (another domain) lists B as a peer, as after an
    # address is reused by a different ComputeDomain (upstream #1447).
    a_addr, b_addr = free_loopback_addresses(2)
    b = cluster.add(SimNode(b_addr, cluster.root / "b", "domain-b"))
    b.write_config([b_addr])
    a = cluster.add(SimNode(a_addr, cluster.root / "a", "domain-a"))
    a.write_config([a_addr, b_addr])
    b.spawn()
    await b.wait_state(READY)
    a.spawn()
    await a.wait_state(WAITING)
    await asyncio.sleep(0.5)  # several connection attempts

    assert await a.state() == WAITING
    assert await b.state() == READY
    status = await a.status()
    assert status.connections[b_addr] == "NODE_MAP_MISMATCH"
    assert "domain-b" in status.reasons[b_addr]
    assert f"Refused connection from {a_addr}: node map mismatch: peer domain domain-a" in b.log_text()
    assert f"({b_addr}) refused by the peer: node map mismatch" in a.log_text()
    table = await ctl(a, "-N")
    assert "!M!" in table.stdout and "Domain State: DEGRADED" in table.stdout


async def test_sigusr1_applies_a_new_member_set_without_restart(cluster: SimCluster):
    n0, n1, n2 = cluster.domain(3)
    await start([n0, n1, n2])
    pids = (n0.proc.pid, n1.proc.pid)  # type: ignore[union-attr]

    # Scale: n2 leaves, n3 joins. The new member starts with the new list; the others keep
    # running and are reconfigured in place.
    (n3_addr,) = [a for a in free_loopback_addresses(4) if a not in {n0.address, n1.address, n2.address}][:1]
    n3 = cluster.add(SimNode(n3_addr, cluster.root / n3_addr, n0.domain_id))
    members = [n0.address, n1.address, n3_addr]
    n3.write_config(members)
    for node in (n0, n1):
        node.write_nodes(members)
    n3.spawn()
    await n3.wait_state(READY)  # n0/n1 accept it as a same-domain peer before their reload
    assert (await n0.status()).nodes == (n0.address, n1.address, n2.address)  # not re-read yet

    for node in (n0, n1):
        node.signal(signal.SIGUSR1)
    n2.signal(signal.SIGTERM)
    assert n2.wait_exit() == 0
    for node in (n0, n1):
        status = await node.wait_until(
            lambda st: st.nodes == tuple(members) and st.state == READY, "READY with the new members"
        )
        assert status.connections == dict.fromkeys(members, "CONNECTED")
    assert (n0.proc.pid, n1.proc.pid) == pids and n0.proc.poll() is None and n1.proc.poll() is None  # type: ignore[union-attr]
    assert f"Peers added: ['{n3_addr}']; removed: ['{n2.address}']" in n0.log_text()
    report = await client.query_nodes(members, DEFAULT_CMD_PORT, 1.0)
    assert report["status"] == "UP"


async def test_sigterm_exits_zero_and_peers_notice_at_once(cluster: SimCluster):
    n0, n1 = cluster.domain(2)
    await start([n0, n1])
    n1.signal(signal.SIGTERM)
    assert n1.wait_exit() == 0
    await n0.wait_state(WAITING, timeout_s=1.0)  # BYE, not a heartbeat timeout
    assert "peer is shutting down" in n0.log_text()
    assert "Received SIGTERM, shutting down" in n1.log_text()


async def test_crash_fault_exits_non_zero_and_a_restarted_peer_is_reconnected(cluster: SimCluster):
    n0, n1 = cluster.domain(2)
    await start([n0, n1])
    await client.inject_fault(n1.address, DEFAULT_CMD_PORT, "crash")
    assert n1.wait_exit() == 1
    await n0.wait_state(WAITING, timeout_s=1.0)
    assert "Fault injected: crash" in n1.log_text()

    n1.spawn()  # what the supervisor does after a crash
    await n1.wait_state(READY)
    await n0.wait_state(READY, timeout_s=2.0)


async def test_hang_fault_makes_queries_time_out_and_peers_drop_it(cluster: SimCluster):
    n0, n1 = cluster.domain(2, heartbeat_s=0.2)
    await start([n0, n1])
    assert (await ctl(n1, "--inject", "hang")).stdout == "OK\n"

    began = time.monotonic()
    quick = await ctl(n1, "-q", "--timeout", "0.5")
    assert (quick.returncode, quick.stdout) == (1, "UNAVAILABLE\n")
    assert "no reply" in quick.stderr
    assert time.monotonic() - began < 5
    assert not await client.query_ready(n1.address, DEFAULT_CMD_PORT, 0.3)

    await n0.wait_state(WAITING, timeout_s=2.0)  # heartbeat timeout: 3 x 0.2 s
    assert "heartbeat timeout" in n0.log_text()
    n1.signal(signal.SIGTERM)  # a hung daemon does not even handle SIGTERM
    with pytest.raises(subprocess.TimeoutExpired):
        n1.wait_exit(timeout=0.3)
    n1.kill()


async def test_drop_peer_until_heal_or_sigusr1(cluster: SimCluster):
    n0, n1, n2 = cluster.domain(3)
    await start([n0, n1, n2])

    await client.inject_fault(n0.address, DEFAULT_CMD_PORT, "drop-peer", n1.address)
    await n0.wait_state(WAITING, timeout_s=1.0)
    await n1.wait_state(WAITING, timeout_s=1.0)  # n0 refuses it too
    await asyncio.sleep(0.4)  # retries keep failing while dropped
    assert await n0.state() == WAITING and await n1.state() == WAITING
    assert await n2.state() == READY
    assert (await n0.status()).dropped == (n1.address,)

    await client.inject_fault(n0.address, DEFAULT_CMD_PORT, "heal")
    for node in (n0, n1):
        await node.wait_state(READY, timeout_s=2.0)

    assert (await ctl(n0, "--inject", "drop-peer", n2.address)).returncode == 0
    await n0.wait_state(WAITING, timeout_s=1.0)
    n0.signal(signal.SIGUSR1)  # also heals
    await n0.wait_state(READY, timeout_s=2.0)


async def test_quorum_none_is_ready_without_its_peers(cluster: SimCluster):
    (n0, _absent) = cluster.domain(2, wait_for_quorum="NONE")
    n0.spawn()
    await n0.wait_state(READY, timeout_s=3.0)
    assert (await n0.status()).connections[_absent.address] == "NEVER_CONNECTED"


async def test_ctl_without_a_daemon_or_config(cluster: SimCluster):
    (n0,) = cluster.domain(1)
    quick = await ctl(n0, "-q", "--timeout", "0.5")
    assert (quick.returncode, quick.stdout) == (1, "UNAVAILABLE\n")
    full = json.loads((await ctl(n0, "-N", "-j", "--timeout", "0.5")).stdout)
    assert full["status"] == "DOWN" and full["nodes"]["0"]["status"] == "UNAVAILABLE"
    missing = await ctl(cluster.root / "nope.cfg", "-q")
    assert missing.returncode == 255 and "Failed to read configuration file" in missing.stderr


async def test_start_failures_exit_non_zero_with_the_reason_in_the_log(cluster: SimCluster):
    n0, n1 = cluster.domain(2)
    n0.spawn()
    await n0.wait_state(WAITING)  # listening (n1 is not up)
    twin = cluster.add(SimNode(n0.address, cluster.root / "twin", n0.domain_id))
    twin.write_config([n0.address, n1.address])
    twin.spawn()
    assert twin.wait_exit() == 1
    assert "failed to bind the peer service" in twin.log_text()

    n1.nodes_path.unlink()
    n1.spawn()
    assert n1.wait_exit() == 1
    assert "Failed to read node configuration file" in n1.log_text()


def test_eighteen_daemons_form_a_domain_quickly(cluster: SimCluster):
    nodes = cluster.domain(18)
    began = time.monotonic()
    for node in nodes:
        node.spawn()
    elapsed = asyncio.run(_wait_all_ready(nodes, began, deadline_s=20.0))
    print(f"\n18-daemon domain: spawn -> all READY in {elapsed * 1000:.0f} ms")


async def _wait_all_ready(nodes: list[SimNode], began: float, deadline_s: float) -> float:
    pending = [node.address for node in nodes]
    while pending and time.monotonic() - began < deadline_s:
        states = await asyncio.gather(*(client.query_state(a, DEFAULT_CMD_PORT, 0.5) for a in pending))
        pending = [a for a, state in zip(pending, states, strict=True) if state != READY]
        if pending:
            await asyncio.sleep(0.005)
    assert not pending, f"not READY after {deadline_s} s: {pending}"
    return time.monotonic() - began


async def test_optional_sigusr1_rate_limit_ignores_a_quick_repeat(cluster: SimCluster):
    # nvidia-imex processes SIGUSR1 at most once per 5 s; the simulator can be told to do the same.
    n0, n1 = free_loopback_addresses(2)
    node = cluster.add(SimNode(n0, cluster.root / n0, "cd-uid-1", sigusr1_min_interval_s=5.0))
    node.write_config([n0])
    node.spawn()
    await node.wait_state(READY)

    node.write_nodes([n0, n1])
    node.signal(signal.SIGUSR1)
    await node.wait_until(lambda st: st.nodes == (n0, n1), "the first reload")
    node.write_nodes([n0])
    node.signal(signal.SIGUSR1)
    await asyncio.sleep(0.3)
    assert (await node.status()).nodes == (n0, n1)
    assert "Received SIGUSR1 within the rate-limit window, ignored" in node.log_text()


async def test_one_sided_link_stays_up_across_heartbeat_timeouts(cluster: SimCluster):
    # B lists A but A does not list B (A was not reloaded yet): only B dials, and the link must
    # still be kept alive by heartbeats in both directions.
    a_addr, b_addr = free_loopback_addresses(2)
    a = cluster.add(SimNode(a_addr, cluster.root / "a", "cd-uid-1", heartbeat_s=0.1))
    a.write_config([a_addr])
    b = cluster.add(SimNode(b_addr, cluster.root / "b", "cd-uid-1", heartbeat_s=0.1))
    b.write_config([a_addr, b_addr])
    await start([a, b])
    await asyncio.sleep(1.0)  # more than three timeouts (3 x 0.1 s)
    assert await b.state() == READY
    assert "timeout" not in a.log_text() + b.log_text()
    assert "a same-domain node not in the nodes config" in a.log_text()
