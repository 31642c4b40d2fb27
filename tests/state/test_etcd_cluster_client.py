"""The store's etcd client against a real 3-member cluster: endpoints, failover, watches.

Each scenario gets its own cluster (three etcd processes on loopback) because it breaks one.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import aetcd.exceptions
import pytest

from libs.gen.computedomain.state import v1 as pb
from libs.runtime.settings import SettingsError, load_settings
from libs.state.config import EtcdConfig, EtcdSettings
from libs.state.store import Store, with_retries
from libs.state.watch import PrefixWatch, Resync
from tools.controlplane.pki import generate_pki, issue_from_ca
from tools.etcd.server import EtcdCluster, EtcdServer

WATCHES = 40


# ---- settings ----------------------------------------------------------------------------------


def test_endpoint_lists_parse_and_bad_ones_are_named() -> None:
    config = EtcdConfig(endpoint="a:1, b:2,c:3")
    assert config.endpoints == ("a:1", "b:2", "c:3")
    assert (config.host, config.port) == ("a", 1)
    for bad, named in (
        ("a:1,", "'a:1,'"),
        ("a:1,b", "'b'"),
        ("a:1,a:1", "'a:1' is listed twice"),
        ("a:0", "'a:0'"),
    ):
        with pytest.raises(ValueError, match=named):
            EtcdConfig(endpoint=bad)


def test_etcd_endpoints_flag_replaces_the_single_endpoint() -> None:
    listed = load_settings(EtcdSettings, ["--etcd-endpoints", "a:1,b:2"], env={})
    assert EtcdConfig.from_settings(listed).endpoints == ("a:1", "b:2")
    single = load_settings(EtcdSettings, ["--etcd-endpoint", "a:1,b:2"], env={})
    assert EtcdConfig.from_settings(single).endpoints == ("a:1", "b:2")
    agreeing = load_settings(EtcdSettings, ["--etcd-endpoint", "b:2", "--etcd-endpoints", "a:1,b:2"], env={})
    assert EtcdConfig.from_settings(agreeing).endpoints == ("a:1", "b:2")
    disagreeing = load_settings(
        EtcdSettings, ["--etcd-endpoint", "c:3", "--etcd-endpoints", "a:1,b:2"], env={}
    )
    with pytest.raises(ValueError, match="--etcd-endpoint 'c:3' is not among --etcd-endpoints"):
        EtcdConfig.from_settings(disagreeing)
    with pytest.raises(SettingsError, match=r"--etcd-endpoints.*'b': expected host:port"):
        load_settings(EtcdSettings, ["--etcd-endpoints", "a:1,b"], env={})


# ---- a real cluster ----------------------------------------------------------------------------


@pytest.fixture
def cluster(etcd_bin: Path, tmp_path: Path) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster.create(tmp_path / "etcd", 3, binary=etcd_bin)
    try:
        cluster.start()
        yield cluster
    finally:
        for member in cluster.members:
            if member.running:
                assert member.process is not None
                os.kill(member.process.pid, signal.SIGCONT)
        cluster.destroy()


def config_starting_at(cluster: EtcdCluster, first: EtcdServer, timeout_s: float = 5.0) -> EtcdConfig:
    others = [m.endpoint for m in cluster.members if m is not first]
    return EtcdConfig(endpoint=",".join([first.endpoint, *others]), prefix="/ha/", timeout_s=timeout_s)


async def test_leader_killed_the_client_moves_to_a_survivor_and_keeps_writing(cluster: EtcdCluster) -> None:
    leader = cluster.leader()
    async with Store(config_starting_at(cluster, leader)) as store:
        await store.put("/ha/before", pb.Claim(uid="before"))
        leader.kill()
        revision = await with_retries(lambda: store.put("/ha/after", pb.Claim(uid="after")), "put", 30.0)
        assert store.client.endpoint != leader.endpoint
        # A survivor may itself time out while the others elect a leader: the client can move twice.
        assert store.client.failovers >= 1
        got = await store.get("/ha/before", pb.Claim)
        assert got is not None and got.value.uid == "before"
        assert revision > got.mod_revision


async def test_a_member_that_stops_answering_is_left_after_a_timed_out_call(cluster: EtcdCluster) -> None:
    leader = cluster.leader()
    follower = next(m for m in cluster.members if m is not leader)
    async with Store(config_starting_at(cluster, follower, timeout_s=1.0)) as store:
        await store.put("/ha/k", pb.Claim(uid="1"))
        assert follower.process is not None
        os.kill(follower.process.pid, signal.SIGSTOP)  # up, connected, silent
        await with_retries(lambda: store.put("/ha/k", pb.Claim(uid="2")), "put", 30.0)
        assert store.client.endpoint != follower.endpoint
        got = await store.get("/ha/k", pb.Claim)
        assert got is not None and got.value.uid == "2"


async def test_watches_resume_on_another_member_without_loss_or_repeat(cluster: EtcdCluster) -> None:
    """Many watches on one client whose member dies between two rounds of writes: each sees every
    write of its prefix once, in order."""
    leader = cluster.leader()
    async with (
        Store(config_starting_at(cluster, leader)) as watching,
        Store(config_starting_at(cluster, leader)) as writing,
    ):
        seen: dict[int, list[str]] = {i: [] for i in range(WATCHES)}
        revisions: dict[int, list[int]] = {i: [] for i in range(WATCHES)}
        ready = [asyncio.Event() for _ in range(WATCHES)]
        both = [asyncio.Event() for _ in range(WATCHES)]

        async def follow(i: int) -> None:
            async for event in PrefixWatch(watching, f"/ha/w{i}/", pb.Claim):
                if isinstance(event, Resync):
                    ready[i].set()
                elif event.value is not None:
                    revisions[i].append(event.revision)
                    if not seen[i] or seen[i][-1] != event.value.uid:
                        seen[i].append(event.value.uid)
                    if len(seen[i]) >= 2:
                        both[i].set()

        async def write_round(tag: str) -> None:
            for i in range(WATCHES):
                await with_retries(
                    lambda i=i: writing.put(f"/ha/w{i}/k", pb.Claim(uid=f"{tag}{i}")), "put", 30.0
                )

        followers = [asyncio.create_task(follow(i)) for i in range(WATCHES)]
        try:
            async with asyncio.timeout(10):
                await asyncio.gather(*(r.wait() for r in ready))
            first = asyncio.create_task(write_round("a"))
            await asyncio.sleep(0.01)
            leader.kill()  # mid-round: some writes land before, some after
            await first
            await write_round("b")
            async with asyncio.timeout(30):
                await asyncio.gather(*(b.wait() for b in both))
            await asyncio.sleep(0.5)  # a repeat would arrive now
        finally:
            for task in followers:
                task.cancel()
            await asyncio.gather(*followers, return_exceptions=True)
        # A put whose answer was lost with the leader is sent again by the writer's retry: the same
        # value may be written twice, at two revisions. A replayed event would repeat a revision.
        assert all(r == sorted(set(r)) for r in revisions.values()), revisions
        assert seen == {i: [f"a{i}", f"b{i}"] for i in range(WATCHES)}
        assert watching.client.failovers >= 1 and watching.client.endpoint != leader.endpoint


async def test_tls_cluster_fails_over_with_client_certificates(etcd_bin: Path, tmp_path: Path) -> None:
    """Peer and client TLS, client certificates required: the client verifies each member it moves
    to and presents its certificate there."""
    pki = generate_pki(tmp_path / "pki", service_ip="10.0.0.1")
    member = issue_from_ca(pki.ca, tmp_path / "pki", "etcd", "etcd", ip_addresses=("127.0.0.1",), server=True)
    cluster = EtcdCluster.create(
        tmp_path / "etcd", 3, binary=etcd_bin, tls=(member.cert, member.key, pki.ca.cert)
    )
    try:
        cluster.start()
        leader = cluster.leader()
        base = config_starting_at(cluster, leader)
        config = EtcdConfig(
            endpoint=base.endpoint,
            prefix=base.prefix,
            ca_file=str(pki.ca.cert),
            cert_file=str(pki.admin.cert),
            key_file=str(pki.admin.key),
        )
        async with Store(config) as store:
            await store.put("/ha/k", pb.Claim(uid="1"))
            leader.kill()
            await with_retries(lambda: store.put("/ha/k", pb.Claim(uid="2")), "put", 30.0)
            assert store.client.endpoint != leader.endpoint
            got = await store.get("/ha/k", pb.Claim)
            assert got is not None and got.value.uid == "2"
        # Without a client certificate every member refuses.
        async with Store(EtcdConfig(endpoint=base.endpoint, prefix="/ha/", ca_file=str(pki.ca.cert))) as bare:
            for _ in cluster.members:
                with pytest.raises(aetcd.exceptions.ConnectionFailedError):
                    await bare.get("/ha/k", pb.Claim)
    finally:
        cluster.destroy()
