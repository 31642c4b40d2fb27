"""HA etcd: the etcd leader is killed during a 36-node formation (two racks of 18).

A real 3-member etcd cluster (three etcd processes on loopback), one `cd-controller` process and
one scale host running the 36 nodes' two programs (simulation mode, real simulated IMEX
daemons), all given the three endpoints with the leader first, so every client starts on the
member that dies. The leader is killed (SIGKILL) as soon as the first node has joined the domain.
The formation must still complete (domain Ready), with nothing lost or duplicated (unique
indices, every claim prepared once, every member present, each node's files as its daemon reads
them), and the services' watches must have resumed on the surviving members: nodes that joined
before the kill resolve the slots of nodes that joined after it, which only a member watch
delivering after the kill tells them.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from libs.contract.names import DRIVER_NAME
from libs.gen.computedomain.state import v1 as pb
from libs.invariants.checker import NodeLocalPaths, check_store_invariants
from libs.state.config import EtcdConfig
from libs.state.store import Store, with_retries
from libs.state.watch import Resync, watch_prefix
from services.nodeagent.core.checkpoint import CHECKPOINT_FILENAME
from tools.bench import formation, simenv
from tools.etcd.server import EtcdCluster, EtcdServer, etcd_binary
from tools.sim.scalesim.agent import AgentLayout

pytestmark = pytest.mark.slow

RACKS = 2
NODES = 36
FORMATION_TIMEOUT_S = 90.0


@dataclass
class Run:
    cluster: EtcdCluster
    leader: EtcdServer
    endpoints: str  # the leader first
    prefix: str
    base: Path
    controller: simenv.ControllerProcess
    host: simenv.HostGroup


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Run]:
    base = simenv.scratch_dir("ha-")  # short: DRA socket paths below it must fit 107 bytes
    cluster = EtcdCluster.create(base / "etcd", 3, binary=etcd_binary())
    controller: simenv.ControllerProcess | None = None
    host: simenv.HostGroup | None = None
    try:
        cluster.start()
        leader = cluster.leader()
        endpoints = ",".join([leader.endpoint, *(m.endpoint for m in cluster.members if m is not leader)])
        prefix = f"/ha-{uuid.uuid4().hex[:8]}/"
        controller = simenv.start_controller(endpoints, prefix, base)
        host = simenv.start_host(
            endpoints, prefix, base, racks=RACKS, nodes=NODES, address_block=simenv.free_address_block(RACKS)
        )
        yield Run(cluster, leader, endpoints, prefix, base, controller, host)
    finally:
        if host is not None:
            host.stop()
        if controller is not None:
            controller.stop()
        simenv.kill_leftover_daemons(base)
        cluster.destroy()
        # The logs stay in pytest's temporary directory (the scratch one is removed).
        for log in [*base.glob("*.log"), *(base / "etcd").glob("*.log")]:
            shutil.copy(log, tmp_path / log.name)
        simenv.remove_tree(base)


@dataclass
class Writer:
    """A client writing a key every 20 ms through the leader loss: the longest gap between two
    acknowledged writes is the pause a client sees."""

    acked: list[float] = field(default_factory=list)

    async def run(self, store: Store, stop: asyncio.Event) -> None:
        key = store.config.prefix + "probe"
        n = 0
        while not stop.is_set():
            n += 1
            value = pb.Claim(uid=str(n))
            await with_retries(lambda v=value: store.put(key, v), "probe write", deadline_s=60.0)
            self.acked.append(time.monotonic())
            await asyncio.sleep(0.02)

    def longest_gap(self, after: float) -> float:
        gaps = [b - a for a, b in zip(self.acked, self.acked[1:], strict=False) if b >= after]
        return max(gaps, default=0.0)


async def _first_member(store: Store, uid: str) -> None:
    async for event in watch_prefix(store, store.keys.members(uid), pb.Member):
        if (isinstance(event, Resync) and event.items) or (not isinstance(event, Resync) and event.value):
            return


def _local_paths(base: Path, node: str) -> NodeLocalPaths:
    layout = AgentLayout(base / "n" / node)
    return NodeLocalPaths(
        name=node,
        cdi_root=layout.cdi_root,
        imex_work_dir=layout.imex_work_dir,
        checkpoint_file=layout.kubelet_dir / "plugins" / DRIVER_NAME / CHECKPOINT_FILENAME,
    )


def _log_events(path: Path) -> Counter[str]:
    """How often each structlog event was logged (JSON lines; other lines are ignored)."""
    seen: Counter[str] = Counter()
    for line in path.read_text(errors="replace").splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and "event" in doc:
            seen[str(doc["event"])] += 1
    return seen


async def _scenario(run: Run) -> dict[str, float]:
    config = EtcdConfig(endpoint=run.endpoints, prefix=run.prefix, timeout_s=5.0)
    async with Store(config) as store, Store(config) as probe_store:
        nodes = list(run.host.sockets)
        assert len(nodes) == NODES
        writer, stop = Writer(), asyncio.Event()
        writing = asyncio.create_task(writer.run(probe_store, stop))
        name = "ha"
        forming = asyncio.create_task(formation.form(store, run.host.sockets, nodes, name))
        # The job's domain uid is chosen inside form(); find it once its record is written.
        uid = ""
        async with asyncio.timeout(30):
            while not uid:
                domains, _ = await store.list(store.keys.domains(), pb.ComputeDomain)
                uid = next((d.value.uid for d in domains if d.value.name == name), "")
                await asyncio.sleep(0.01)
            await _first_member(store, uid)
        kill_revision = await store.revision()
        killed_at = time.monotonic()
        run.leader.kill()
        async with asyncio.timeout(FORMATION_TIMEOUT_S):
            job, formed = await forming
        stop.set()
        await writing

        k = store.keys
        members = [m for m in (await store.list(k.members(uid), pb.Member))[0]]
        preparations = [
            p.value
            for p in (await store.list(k.all_preparations(), pb.PreparedClaim))[0]
            if p.value.domain_uid == uid
        ]
        domain = await store.get(k.domain(uid), pb.ComputeDomain)
        assert store.client.failovers >= 1, "the client never left the killed leader"

        # Every member present, each clique's indices unique and complete.
        assert sorted(m.value.node_name for m in members) == sorted(nodes)
        by_clique: dict[str, list[int]] = {}
        for m in members:
            by_clique.setdefault(m.value.clique_id, []).append(m.value.index)
        assert len(by_clique) == RACKS
        assert all(sorted(indices) == list(range(NODES // RACKS)) for indices in by_clique.values()), (
            by_clique
        )
        # Every claim prepared once, on its own node.
        completed = [p for p in preparations if p.state == pb.PreparedState.PREPARE_COMPLETED]
        assert Counter(p.claim_uid for p in completed) == Counter(c.uid for c in job.claims)
        assert sorted(p.node_name for p in completed) == sorted(nodes)
        # The kill fell inside the formation: nodes joined, and the domain turned Ready, after it.
        joined_after = [m for m in members if m.create_revision > kill_revision]
        assert joined_after, "every node had joined before the leader was killed"
        assert domain is not None and domain.mod_revision > kill_revision
        # Invariants 1-4 with each node's files: every node's hosts file resolves every slot to the
        # member holding it, including the slots of nodes that joined after the kill.
        local = [_local_paths(run.base, n) for n in nodes]
        assert await check_store_invariants(store, nodes=local) == []
        # Each node's checkpoint holds its one claim, prepared once.
        claim_of = {c.node: c.uid for c in job.claims}
        for paths in local:
            entries = json.loads(paths.checkpoint_file.read_text())["entries"]
            assert list(entries) == [claim_of[paths.name]], (paths.name, entries)
            assert entries[claim_of[paths.name]]["state"] == "PrepareCompleted"
        return {
            "ready_s": formed.ready_s,
            "joined_after_kill": float(len(joined_after)),
            "write_pause_s": writer.longest_gap(killed_at),
            "killed_after_s": killed_at - writer.acked[0],
        }


def test_etcd_leader_killed_mid_formation(run: Run) -> None:
    began = time.monotonic()
    figures = asyncio.run(_scenario(run))
    # Survivors still form a cluster with a new leader.
    assert run.cluster.leader() is not run.leader
    # The services left the dead member and resumed their watches on another one.
    controller = _log_events(run.controller.log)
    host: Counter[str] = Counter()
    for h in run.host.hosts:
        host += _log_events(h.log)
    switch = "etcd endpoint failed; switching to the next member"
    assert controller[switch] >= 1, controller
    assert host[switch] >= 1, host
    assert host["watch stream lost; resuming"] >= 1, host
    # A client's pause on leader loss: the longest gap between acknowledged writes.
    assert figures["write_pause_s"] < 15.0, figures
    print(
        f"\nleader {run.leader.name} killed mid-formation: Ready in {figures['ready_s']:.1f}s, "
        f"{figures['joined_after_kill']:.0f} nodes joined after the kill, longest write pause "
        f"{figures['write_pause_s']:.2f}s; scenario {time.monotonic() - began:.1f}s"
    )
