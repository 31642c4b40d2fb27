"""SIGUSR1 with TLS, as NVIDIA's IMEX guide ("Signal handling") describes it: reload the credential
files, tell every peer to reload, restart the outgoing connections; a failed reload skips the last
two steps, keeps the old credentials and every connection, and says why."""

from __future__ import annotations

import signal
from datetime import timedelta
from pathlib import Path

from libs.imex import mesh_pki
from services.imexagent.probe import CtlProbe
from tests.imex.simdomain import SimCluster, SimNode, start
from tests.imex.test_imex_mesh_tls import (
    DOMAIN,
    PORT,
    assert_job_intact,
    now,
    running_job,
    tls_domain,
    write_credentials,
)
from tools.sim.imex import client
from tools.sim.imex.port import SimulatorCtl

ESTABLISHED = "Connection established to node"


def tear(path: Path) -> None:
    path.write_text("-----BEGIN CERTIFICATE-----\ntorn\n")


def established(nodes: list[SimNode]) -> list[int]:
    return [node.log_text().count(ESTABLISHED) for node in nodes]


async def test_a_reload_of_an_unusable_file_keeps_the_mesh_and_says_why(cluster: SimCluster) -> None:
    ca = mesh_pki.new_domain_authority(DOMAIN, now=now(), validity=timedelta(days=1))
    nodes = tls_domain(cluster, 3, ca)
    await start(nodes)
    instances = await running_job(nodes)
    before = established(nodes)
    assert nodes[0].mesh_tls is not None
    tear(Path(nodes[0].mesh_tls.cert))
    nodes[0].signal(signal.SIGUSR1)
    await nodes[0].wait_log("Reloading SSL credentials failed, keeping the previous ones and all connections")
    status = await nodes[0].wait_until(lambda st: bool(st.credentials_error), "credentials error in STATUS")
    assert "IMEX_SERVER_CERT" in status.credentials_error
    # What the IMEX agent reads, and reports as the last error of a daemon that stays READY.
    assert nodes[0].proc is not None
    probed = await CtlProbe(SimulatorCtl(), node_id=0).probe(nodes[0].config_path, nodes[0].proc.pid, 1.0)
    assert probed.ready and probed.credentials_error == status.credentials_error
    # No link was restarted and no peer was asked to reload: nothing to see anywhere.
    await nodes[0].wait_connected(range(3))
    assert established(nodes) == before
    assert not any("reloaded its SSL credentials" in n.log_text() for n in nodes[1:])
    await assert_job_intact(nodes, instances)
    # The old credentials still serve: a peer that re-dials gets in.
    nodes[1].signal(signal.SIGUSR1)
    await nodes[1].wait_log(f"{ESTABLISHED} 0 with address", count=2, timeout_s=10)
    # A good file and the next SIGUSR1 clear the error.
    write_credentials(nodes[0], 0, ca)
    nodes[0].signal(signal.SIGUSR1)
    await nodes[0].wait_until(lambda st: not st.credentials_error, "credentials error cleared")
    await assert_job_intact(nodes, instances)


async def test_a_successful_reload_makes_every_peer_reload(cluster: SimCluster) -> None:
    ca = mesh_pki.new_domain_authority(DOMAIN, now=now(), validity=timedelta(days=1))
    nodes = tls_domain(cluster, 3, ca)
    await start(nodes)
    instances = await running_job(nodes)
    for index, node in enumerate(nodes):  # new certificates everywhere, one signal
        write_credentials(node, index, ca)
    nodes[0].signal(signal.SIGUSR1)
    await nodes[0].wait_log("Asked 2 peer(s) to reload their SSL credentials")
    for peer in nodes[1:]:
        log = await peer.wait_log("Node 0 reloaded its SSL credentials; reloading ours")
        await peer.wait_log("Reloaded SSL credentials")
        assert "Asked" not in log  # a peer's reload is not passed on
        # The peer restarted its outgoing links with its new credentials.
        await peer.wait_log(f"{ESTABLISHED} 0 with address", count=2, timeout_s=10)
    await assert_job_intact(nodes, instances)
    for node in nodes:
        assert not (await node.status()).credentials_error


async def test_sigusr1_is_acted_on_once_per_5_seconds_with_tls(cluster: SimCluster) -> None:
    ca = mesh_pki.new_domain_authority(DOMAIN, now=now(), validity=timedelta(days=1))
    nodes = tls_domain(cluster, 2, ca)
    for node in nodes:
        node.sigusr1_min_interval_s = None  # nvidia-imex's 5 s
        node.write_config([n.address for n in nodes])
    await start(nodes)
    nodes[0].signal(signal.SIGUSR1)
    await nodes[0].wait_log("Reloaded SSL credentials")
    nodes[0].signal(signal.SIGUSR1)
    log = await nodes[0].wait_log("Received SIGUSR1 within 5 s of the last one, ignored")
    assert log.count("Received SIGUSR1: reloading SSL credentials") == 1
    assert (await client.query_status(nodes[0].address, PORT)).state == "READY"
