"""A node's programs as real processes: the kubelet plugin and the IMEX agent on simulated
hardware, real etcd, simulated IMEX daemons over TCP."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator

import pytest

from libs.cdi.versions import check_cdi_version
from libs.gen.computedomain.state import v1 as pb
from libs.imex.slots import PLACEHOLDER_ADDRESS
from libs.invariants.checker import check_domain_gone, check_store_invariants, imex_processes_of
from libs.state.config import EtcdConfig
from libs.state.store import Store
from libs.state.watch import WatchEvent, watch_prefix
from services.nodeagent.wire.driver import dra_socket_path
from services.nodeagent.wire.registration import registration_socket_path
from tests.cdi.cdi_schema_check import cdi_check, loader_violations, schema_errors, unknown_fields
from tests.nodeagent.agent_fakes import file_tree, put_claim, put_domain, store_dump
from tests.nodeagent.agent_procs import AgentProcess, Kubelet, SimCluster, sim_cluster
from tests.polling import eventually
from tools.etcd.server import EtcdServer

pytestmark = pytest.mark.slow


@pytest.fixture
async def sim(etcd_config: EtcdConfig) -> AsyncIterator[SimCluster]:
    with sim_cluster(etcd_config) as cluster:
        yield cluster


async def start_agents(
    sim: SimCluster, *names: str, extra_args: list[str] | None = None
) -> list[AgentProcess]:
    agents = [sim.agent(n, extra_args) for n in names]
    for agent in agents:
        agent.start_node()
    await asyncio.gather(*(a.wait_serving() for a in agents))
    return agents


# Real agent and daemon processes on two shared cores: generous, still bounded.
WAIT_S = 15.0


def node_files(agents: list[AgentProcess]) -> dict[str, bytes]:
    """What an agent keeps on disk, without logs (they grow by themselves)."""
    tree: dict[str, bytes] = {}
    for agent in agents:
        for root in (agent.cdi_root, agent.imex_work_dir, agent.checkpoint_file.parent):
            for rel, content in file_tree(root).items():
                if not rel.endswith(".log"):
                    tree[f"{agent.name}:{root.name}/{rel}"] = content
    return tree


async def test_three_agents_form_a_domain_and_refuse_a_foreign_namespace(
    sim: SimCluster, store: Store
) -> None:
    names = ["rack0-tray0", "rack0-tray1", "rack0-tray2"]
    agents = await start_agents(sim, *names)
    domain = await put_domain(store, namespace="team-a")
    refs = [await put_claim(store, n, domain.uid, namespace="team-a") for n in names]

    answers = await asyncio.gather(*(Kubelet(a).prepare(r, 30) for a, r in zip(agents, refs, strict=True)))

    for agent, ref, answer in zip(agents, refs, answers, strict=True):
        assert answer.error == ""
        assert [(d.pool_name, d.device_name, d.cdi_device_ids) for d in answer.devices] == [
            (agent.name, "channel-0", [f"k8s.compute-domain.nvidia.com/claim={ref.uid}-channel-0"])
        ]
        spec = json.loads(agent.cdi_spec(ref.uid).read_text())
        assert schema_errors(spec) == [] and unknown_fields(spec) == [] and loader_violations(spec) == []
        check_cdi_version(spec)
        # The CDI package itself (as the runtime) loads the agent's spec dir and resolves the ids.
        loaded = cdi_check(agent.cdi_root)
        assert loaded["errors"] == {} and loaded["devices"] == answer.devices[0].cdi_device_ids
        (node,) = spec["devices"][0]["containerEdits"]["deviceNodes"]
        assert (node["path"], node["major"], node["minor"]) == (
            "/dev/nvidia-caps-imex-channels/channel0",
            sim.cluster.imex_channel_major,
            0,
        )
    members, _ = await store.list(store.keys.members(domain.uid), pb.Member)
    assert sorted(m.value.index for m in members) == [0, 1, 2]
    addresses = sorted(sim.cluster.node(n).address for n in names)

    async def all_ready() -> bool:
        statuses, _ = await store.list(store.keys.daemons(domain.uid), pb.DaemonStatus)
        return len(statuses) == 3 and all(
            s.value.state == pb.DaemonState.READY
            and sorted(p for p in s.value.peers if p != PLACEHOLDER_ADDRESS) == addresses
            for s in statuses
        )

    await eventually(all_ready, "3 READY daemons with 3 peers each", WAIT_S)
    assert await check_store_invariants(store) == []

    # Namespace isolation: a claim in team-b naming team-a's domain is refused, nothing changes.
    intruder = await put_claim(store, names[0], domain.uid, namespace="team-b")
    # The IMEX agents' own daemon reports move on by themselves (peer links settling); the
    # refused prepare must change nothing else.
    daemons = store.keys.all_daemons()

    async def records() -> dict[str, tuple[bytes, int]]:
        return {k: v for k, v in (await store_dump(store)).items() if not k.startswith(daemons)}

    before_store, before_files = await records(), node_files(agents)
    answer = (await Kubelet(agents[0]).prepare_once(intruder))[intruder.uid]
    assert "not in namespace team-b" in answer.error and answer.devices == []
    assert await records() == before_store
    assert node_files(agents) == before_files

    # Teardown: every claim released, domain deleted -> nothing of it remains anywhere.
    errors = await asyncio.gather(*(Kubelet(a).unprepare_once(r) for a, r in zip(agents, refs, strict=True)))
    assert errors == [{r.uid: ""} for r in refs]
    for ref in [*refs, intruder]:  # the claims go, as kubelet's pods and cdsim's jobs do
        await store.delete(store.keys.claim(ref.uid))
    await store.delete(store.keys.domain(domain.uid))

    left: list[str] = []

    async def gone() -> bool:
        left[:] = await check_domain_gone(
            store, domain.uid, [r.uid for r in refs], [a.local_paths for a in agents]
        )
        return left == []

    await eventually(gone, "domain teardown", WAIT_S, explain=lambda: f"left: {left}")

    # Graceful shutdown: exit 0, sockets removed.
    for agent in agents:
        assert agent.stop_node() == 0, agent.log_tail()
        assert not dra_socket_path(agent.kubelet_dir).exists()
        assert not registration_socket_path(agent.kubelet_dir).exists()


async def test_plugin_killed_mid_prepare_ends_prepared_once(sim: SimCluster, store: Store) -> None:
    (agent,) = await start_agents(sim, "rack0-tray0", extra_args=["--prepare-budget-s", "20"])
    assert agent.imex is not None
    # The IMEX agent is down: nobody starts the daemon, so the prepare stays between
    # PrepareStarted and PrepareCompleted (the plugin keeps the node record it saw).
    assert agent.imex.stop() == 0, agent.log_tail()
    domain = await put_domain(store)
    ref = await put_claim(store, agent.name, domain.uid)
    kubelet = Kubelet(agent)
    in_flight = asyncio.create_task(kubelet.prepare_once(ref))

    async def started() -> bool:
        got = await store.get(store.keys.preparation(agent.name, ref.uid), pb.PreparedClaim)
        return got is not None and got.value.state == pb.PreparedState.PREPARE_STARTED

    await eventually(started, "PrepareStarted", WAIT_S)
    assert json.loads(agent.checkpoint_file.read_text())["entries"][ref.uid]["state"] == "PrepareStarted"
    agent.kill()
    with pytest.raises(Exception):  # noqa: B017 - the connection dies with the plugin
        await in_flight
    assert not agent.cdi_spec(ref.uid).exists()

    agent.start_node()  # both come back: the IMEX agent runs the daemon, the retry finishes
    await agent.wait_serving()
    answer = await kubelet.prepare(ref, 30)
    assert answer.error == ""
    assert answer.devices[0].cdi_device_ids == [f"k8s.compute-domain.nvidia.com/claim={ref.uid}-channel-0"]
    preps, _ = await store.list(store.keys.all_preparations(), pb.PreparedClaim)
    assert [(p.value.claim_uid, p.value.state) for p in preps] == [
        (ref.uid, pb.PreparedState.PREPARE_COMPLETED)
    ]
    members, _ = await store.list(store.keys.members(domain.uid), pb.Member)
    assert [(m.value.node_name, m.value.index) for m in members] == [(agent.name, 0)]
    entries = json.loads(agent.checkpoint_file.read_text())["entries"]
    assert list(entries) == [ref.uid] and entries[ref.uid]["state"] == "PrepareCompleted"
    assert sorted(p.name for p in agent.cdi_root.iterdir()) == [agent.cdi_spec(ref.uid).name]

    async def one_daemon() -> bool:
        return len(imex_processes_of(domain.uid)) == 1

    await eventually(one_daemon, "exactly one IMEX daemon for the domain", WAIT_S)
    assert await check_store_invariants(store) == []


async def test_killed_imex_daemon_is_restarted_and_its_absence_reported(
    sim: SimCluster, store: Store
) -> None:
    (agent,) = await start_agents(sim, "rack0-tray1")
    domain = await put_domain(store)
    ref = await put_claim(store, agent.name, domain.uid)
    assert (await Kubelet(agent).prepare(ref, 30)).error == ""
    key = store.keys.daemon(domain.uid, agent.name)
    status = await store.get(key, pb.DaemonStatus)
    assert status is not None and status.value.state == pb.DaemonState.READY and status.value.pid > 0
    old_pid = status.value.pid

    seen: list[pb.DaemonStatus] = []

    async def record() -> None:
        async for event in watch_prefix(store, store.keys.daemons(domain.uid), pb.DaemonStatus):
            if isinstance(event, WatchEvent) and event.value is not None:
                seen.append(event.value)

    watcher = asyncio.create_task(record())
    await asyncio.sleep(0.3)  # the watch is established
    os.kill(old_pid, signal.SIGKILL)

    async def back() -> bool:
        got = await store.get(key, pb.DaemonStatus)
        return got is not None and got.value.state == pb.DaemonState.READY and got.value.pid != old_pid

    await eventually(back, "the daemon READY again under a new pid", WAIT_S)
    watcher.cancel()
    down = [s for s in seen if s.state != pb.DaemonState.READY]
    assert down, "the store never showed the daemon down"
    assert any(s.last_error for s in down), f"no reason given while down: {down}"
    final = await store.get(key, pb.DaemonStatus)
    assert final is not None and final.value.restarts >= 1
    # The claim stays prepared, and a second claim prepares on the restarted daemon.
    second = await put_claim(store, agent.name, domain.uid)
    assert (await Kubelet(agent).prepare(second, 30)).error == ""
    assert await check_store_invariants(store) == []


async def test_all_mode_and_non_fabric_node(sim: SimCluster, store: Store) -> None:
    sim.faults("rack0-tray3").set_non_fabric()
    fabric, plain = await start_agents(sim, "rack0-tray2", "rack0-tray3")
    domain = await put_domain(store)
    wide = await put_claim(store, fabric.name, domain.uid, mode="All")
    bare = await put_claim(store, plain.name, domain.uid, mode="All")
    answers = await asyncio.gather(Kubelet(fabric).prepare(wide, 30), Kubelet(plain).prepare(bare, 30))
    assert [a.error for a in answers] == ["", ""]

    nodes = json.loads(fabric.cdi_spec(wide.uid).read_text())["devices"][0]["containerEdits"]["deviceNodes"]
    assert [n["minor"] for n in nodes] == list(range(2048))
    plain_spec = json.loads(plain.cdi_spec(bare.uid).read_text())
    assert "deviceNodes" not in plain_spec["devices"][0]["containerEdits"]
    assert loader_violations(plain_spec) == [] and schema_errors(plain_spec) == []
    for agent, answer in zip((fabric, plain), answers, strict=True):
        loaded = cdi_check(agent.cdi_root)
        assert loaded["errors"] == {} and loaded["devices"] == answer.devices[0].cdi_device_ids
    member = await store.get(store.keys.member(domain.uid, plain.name), pb.Member)
    assert member is not None and member.value.index == -1 and member.value.clique_id == ""
    assert await store.get(store.keys.daemon(domain.uid, plain.name), pb.DaemonStatus) is None
    assert not (plain.imex_work_dir / domain.uid).exists()
    assert await check_store_invariants(store) == []


async def test_malformed_config_and_unknown_claims_through_the_socket(sim: SimCluster, store: Store) -> None:
    (agent,) = await start_agents(sim, "rack0-tray0")
    domain = await put_domain(store)
    params = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomainChannelConfig",
        "domainID": domain.uid,
        "channels": 4,
    }
    bad = await put_claim(store, agent.name, domain.uid, parameters=params)
    kubelet = Kubelet(agent)
    answer = (await kubelet.prepare_once(bad))[bad.uid]
    assert 'unknown field "channels"' in answer.error
    ghost = await put_claim(store, agent.name, domain.uid)
    assert await kubelet.unprepare_once(ghost) == {ghost.uid: ""}
    stale = (await kubelet.prepare_once(ghost))[ghost.uid]
    assert "refusing a stale prepare" in stale.error
    metrics = await agent.metrics()
    assert 'cd_nodeagent_prepare_total{outcome="permanent"} 2.0' in metrics
    assert 'cd_nodeagent_unprepare_total{outcome="ok"} 1.0' in metrics
    assert await store.get(store.keys.member(domain.uid, agent.name), pb.Member) is None
    assert file_tree(agent.cdi_root) == {}


async def test_plugin_restart_changes_nothing_in_the_store_and_keeps_the_daemon(
    sim: SimCluster, store: Store
) -> None:
    (agent,) = await start_agents(sim, "rack0-tray1")
    domain = await put_domain(store)
    ref = await put_claim(store, agent.name, domain.uid)
    first = await Kubelet(agent).prepare(ref, 30)
    assert first.error == ""
    daemon_key = store.keys.daemon(domain.uid, agent.name)
    status = await store.get(daemon_key, pb.DaemonStatus)
    assert status is not None and status.value.state == pb.DaemonState.READY
    # Everything the plugin or the membership owns, with its revision (the node record is the
    # IMEX agent's, rewritten on its lease; the daemon's record is compared by instance below).
    watched = (
        store.keys.members(domain.uid),
        store.keys.member_indices(domain.uid),
        store.keys.node_binding(agent.name),
        store.keys.preparations(agent.name),
    )

    async def revisions() -> dict[str, int]:
        return {k: rev for k, (_, rev) in (await store_dump(store)).items() if k.startswith(watched)}

    before = await revisions()
    assert len(before) == 4, before

    assert agent.stop() == 0, agent.log_tail()  # SIGTERM: an upgrade of the plugin
    assert not dra_socket_path(agent.kubelet_dir).exists()
    assert imex_processes_of(domain.uid) == [status.value.pid]  # the daemon is not the plugin's
    agent.start()
    await agent.wait_serving()

    assert (await Kubelet(agent).prepare_once(ref))[ref.uid] == first  # answered from the checkpoint
    assert await revisions() == before
    after = await store.get(daemon_key, pb.DaemonStatus)
    assert after is not None and after.value.state == pb.DaemonState.READY
    assert (after.value.instance, after.value.pid) == (status.value.instance, status.value.pid)
    assert f'cd_nodeagent_imex_daemon_restarts{{cd_uid="{domain.uid}"}} 0.0' in await agent.metrics()
    assert await check_store_invariants(store) == []


async def test_agent_started_before_etcd_waits_for_it_instead_of_exiting(private_etcd: EtcdServer) -> None:
    """A node reboots faster than the control plane: the agent must come up once etcd does."""
    config = EtcdConfig(endpoint=private_etcd.endpoint, prefix="/agent-first/", timeout_s=2.0)
    private_etcd.stop()
    with sim_cluster(config) as cluster:
        agent = cluster.agent("rack0-tray0")
        agent.start_node()
        await asyncio.sleep(3.0)
        assert agent.running and agent.imex is not None and agent.imex.running, (
            f"a program exited while etcd was down:\n{agent.log_tail()}"
        )
        private_etcd.start()
        await agent.wait_serving(timeout_s=30.0)
        async with Store(config) as store:
            node = await store.get(store.keys.node(agent.name), pb.Node)
        assert node is not None and node.value.name == agent.name
