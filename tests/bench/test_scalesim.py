"""Scale mode: hosted agents serve kubelet and form a domain like agent processes do."""

from __future__ import annotations

import asyncio
import os
import stat
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.gen.computedomain.state import v1 as pb
from libs.state.config import EtcdConfig
from libs.state.store import Put, Store
from tools.bench import simenv
from tools.cdsim import kubelet, proc_scan
from tools.cdsim.job_book import Job
from tools.cdsim.jobs import build_claim, build_domain, plan_claims
from tools.sim.hardware.cluster import ClusterDescription
from tools.sim.scalesim.agent import AgentOptions
from tools.sim.scalesim.host import ScaleHost, kube_client, spread_nodes
from tools.sim.scalesim.main import parse_args, shard_of


@pytest.fixture
def state_dir() -> Iterator[Path]:
    # Short, so the agents' socket paths stay under the 107-byte limit of unix sockets.
    path = simenv.scratch_dir("ss-")
    yield path
    simenv.kill_leftover_daemons(path)
    simenv.remove_tree(path)


def test_spread_nodes_fills_racks_evenly_from_tray_0() -> None:
    cluster = ClusterDescription(racks=15)
    nodes = spread_nodes(cluster, 256)
    assert len(nodes) == len(set(nodes)) == 256
    per_rack = [sum(1 for n in nodes if n.startswith(f"rack{r}-")) for r in range(15)]
    assert sorted(per_rack) == [17] * 14 + [18]
    assert "rack0-tray0" in nodes and "rack14-tray16" in nodes and "rack14-tray17" not in nodes
    with pytest.raises(ValueError):
        spread_nodes(cluster, 271)


def test_shards_split_the_nodes_into_contiguous_parts() -> None:
    nodes = spread_nodes(ClusterDescription(racks=15), 256)
    parts = [shard_of(nodes, i, 2) for i in range(2)]
    assert parts[0] + parts[1] == nodes  # every node once, racks in order
    assert [len(p) for p in parts] == [128, 128]
    assert [len(p) for p in (shard_of(nodes[:5], i, 3) for i in range(3))] == [2, 2, 1]
    args = parse_args(["--state-dir=x", "--etcd-endpoint=e", "--shard=1/2"])
    assert args.shard == (1, 2)
    for bad in ("2/2", "1", "a/b", "-1/2"):
        with pytest.raises(SystemExit):
            parse_args(["--state-dir=x", "--etcd-endpoint=e", f"--shard={bad}"])


def _job(nodes: list[str]) -> Job:
    return Job(
        name="scale",
        namespace="default",
        domain_uid=str(uuid.uuid4()),
        num_nodes=len(nodes),
        allocation_mode="Single",
        state="submitting",
        created_unix_ms=int(time.time() * 1000),
        claims=plan_claims("scale", "default", nodes),
    )


def plaintext(domain: pb.ComputeDomain) -> pb.ComputeDomain:
    """The mesh mode the controller would record (no controller runs here)."""
    domain.mesh_mode = pb.MeshMode.PLAINTEXT
    return domain


async def test_hosted_agents_prepare_through_their_sockets_and_stop_their_daemons(
    etcd_config: EtcdConfig, store: Store, state_dir: Path
) -> None:
    block = simenv.free_address_block(racks=1, trays_per_rack=3)
    cluster = ClusterDescription(racks=1, trays_per_rack=3, seed=state_dir.name, address_block=block)
    nodes = spread_nodes(cluster, 3)
    host = ScaleHost(cluster, nodes, state_dir, etcd_config, AgentOptions(), store_pool=2)
    try:
        report = await host.start(timeout_s=60)
        assert set(report.nodes) == set(nodes) and report.lease_losses == 0
        for node in nodes:
            layout = host.layout(node)
            for sock in (layout.dra_socket, layout.registration_socket):
                mode = os.stat(sock).st_mode
                assert stat.S_ISSOCK(mode) and not mode & 0o002
            assert await store.get(store.keys.node(node), pb.Node) is not None

        job = _job(nodes)
        await store.txn(
            [],
            [
                Put(store.keys.domain(job.domain_uid), plaintext(build_domain(job, job.created_unix_ms))),
                *(
                    Put(
                        store.keys.claim(c.uid), build_claim(c, job.domain_uid, "Single", job.created_unix_ms)
                    )
                    for c in job.claims
                ),
            ],
        )
        calls = [
            kubelet.ClaimCall(c.namespace, c.name, c.uid, c.node, Path(report.nodes[c.node]))
            for c in job.claims
        ]
        outcomes = [await kubelet.prepare(call, deadline_s=60) for call in calls]
        assert all(o.ok for o in outcomes), [o.errors for o in outcomes]
        statuses, _ = await store.list(store.keys.daemons(job.domain_uid), pb.DaemonStatus)
        assert {s.value.node_name for s in statuses if s.value.state == pb.DaemonState.READY} == set(nodes)
        for outcome, claim in zip(outcomes, job.claims, strict=True):
            cdi_files = list(host.layout(claim.node).cdi_root.glob("*.json"))
            assert len(cdi_files) == 1 and outcome.cdi_device_ids
        assert len(proc_scan.imex_daemons_under(state_dir)) == 3

        assert all([(await kubelet.unprepare(call, deadline_s=30)).ok for call in calls])
        members, _ = await store.list(store.keys.members(job.domain_uid), pb.Member)
        assert members == []
        # Leaving the domain stops each node's daemon (invariant 5 of docs/state-model.md).
        for _ in range(150):
            if not proc_scan.imex_daemons_under(state_dir):
                break
            await asyncio.sleep(0.1)
        assert proc_scan.imex_daemons_under(state_dir) == []
        assert await host.stop() == 0  # nothing left for the host to kill
    finally:
        await host.stop()
    assert not any(host.layout(n).dra_socket.exists() for n in nodes)


async def test_inventory_only_agents_keep_their_node_records_on_leases(
    etcd_config: EtcdConfig, store: Store, state_dir: Path
) -> None:
    cluster = ClusterDescription(racks=3, seed=state_dir.name)
    nodes = spread_nodes(cluster, 40)
    host = ScaleHost(
        cluster, nodes, state_dir, etcd_config, AgentOptions(inventory_only=True, lease_ttl_s=30)
    )
    try:
        report = await host.start(timeout_s=60, batch=16)
        assert report.inventory_only and set(report.nodes) == set(nodes)
        records, _ = await store.list(store.keys.nodes(), pb.Node)
        assert {r.value.name for r in records} == set(nodes)
        assert all(r.lease for r in records) and len({r.lease for r in records}) == 40
        assert not any(host.layout(n).dra_socket.exists() for n in nodes)
    finally:
        await host.stop()


def test_scale_settings_are_valid_imex_settings_at_any_size() -> None:
    from services.imexagent.settings import ImexSettings
    from tools.sim.scalesim.main import scale_poll_interval, scale_waiting_interval

    for nodes in (1, 18, 128, 256, 1008, 10008):
        ImexSettings(  # raises on an invalid combination, naming it
            poll_interval_starting_s=scale_poll_interval(nodes),
            poll_interval_waiting_s=scale_waiting_interval(nodes),
        )
    assert scale_poll_interval(18) == 0.025 and scale_waiting_interval(18) == 0.25  # the agent's own


@pytest.mark.parametrize("nodes", [1, 18, 256])
async def test_the_hosts_api_client_has_a_connection_for_every_nodes_slice_watch_and_more(
    tmp_path: Path, nodes: int
) -> None:
    """Each hosted node keeps a watch of its ResourceSlice open: with fewer connections than
    nodes, the watches take them all and the host's other requests time out waiting."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'http://127.0.0.1:1'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
    )
    api = await kube_client(str(kubeconfig), nodes)
    try:
        assert api.configuration.connection_pool_maxsize >= nodes + 16
    finally:
        await api.close()
