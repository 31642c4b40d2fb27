"""An IMEX agent owns its node record: deleted, overwritten or undecodable, it is written again.

Real etcd, real ``cd-imex-agent`` processes on simulated hardware, and an advisor whose inventory
follows the store, as in production: what an operator's mistaken ``etcdctl del`` or a restore
from an older backup does to placement, and that the invariant checker names a node that is
alive but missing from the inventory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from libs.gen.computedomain.state import v1 as pb
from libs.invariants.checker import check_inventory
from libs.runtime.health import Health
from libs.state.config import EtcdConfig
from libs.state.store import Store
from services.advisor.advisor import Advisor
from services.advisor.model import PlacementRequest, Reason
from services.imexagent.node_record_keeper import NodeRecordKeeper, RecordKeeperSettings
from tests.advisor.fleet import node_record
from tests.advisor.harness import advisor_on_store
from tests.nodeagent.agent_procs import ImexAgentProcess, sim_cluster
from tests.polling import eventually
from tools.sim.hardware.cluster import ClusterDescription
from tools.sim.hardware.simulated import SimulatedNodeHardware, prepare_node_dirs

NODES = 2
# etcd grants at least ~2 s whatever is asked (its minimum lease TTL).
TTL_S = 2
BYSTANDER = node_record(
    "rack9-tray0", "00000000-0000-0000-0000-000000000009.9", "00000000-0000-0000-0000-000000000009"
)
GARBAGE = b"\xff\x00 not a node record \x13\x37"


@dataclass
class Nodes:
    store: Store
    cluster: ClusterDescription
    agents: list[ImexAgentProcess]
    advisor: Advisor

    @property
    def names(self) -> list[str]:
        return [a.name for a in self.agents]

    @property
    def clique(self) -> str:
        return next(iter(self.cluster.nodes())).clique

    async def record(self, name: str) -> pb.Node | None:
        item = await self.store.get(self.store.keys.node(name), pb.Node)
        return item.value if item is not None and item.lease != 0 else None

    async def all_registered(self) -> bool:
        return all([await self.record(n) is not None for n in self.names])

    async def place_all(self) -> Reason | None:
        """Place a job on every node of the clique (None: it fits)."""
        decision = await self.advisor.place(
            PlacementRequest(num_nodes=len(self.names), node_selector={"clique": self.clique})
        )
        return None if decision.feasible else decision.reason

    async def fits(self) -> bool:
        return await self.place_all() is None


@pytest.fixture
async def nodes(store: Store, etcd_config: EtcdConfig) -> AsyncIterator[Nodes]:
    with sim_cluster(etcd_config, trays=NODES) as sim:
        agents = [
            sim.agent(sim.cluster.node_name(0, tray), imex_args=["--lease-ttl-s", str(TTL_S)]).imex
            for tray in range(NODES)
        ]
        for agent in agents:
            assert agent is not None
            agent.start()
        # A node of another clique: with the victim gone the cluster is still big enough, so a
        # Place on the victim's clique is refused for capacity, not as larger than the cluster.
        async with advisor_on_store(store, [BYSTANDER]) as advisor:
            running = Nodes(store, sim.cluster, [a for a in agents if a is not None], advisor)
            await eventually(running.all_registered, "both agents registered", 30.0)
            await eventually(running.fits, "the advisor counts both nodes", 5.0)
            try:
                yield running
            finally:
                for agent in running.agents:
                    if agent.running and agent.process is not None:
                        agent.process.send_signal(signal.SIGCONT)


def _logged(agent: ImexAgentProcess, event: str, text: str) -> bool:
    for line in agent.log_file.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if record.get("event") == event and text in str(record.get("problem", "")):
                return True
    return False


@pytest.mark.parametrize(
    ("damage", "problem"),
    [("delete", "is missing (deleted)"), ("garbage", "undecodable value")],
)
async def test_a_deleted_or_garbled_record_is_back_within_a_lease_period(
    nodes: Nodes, damage: str, problem: str
) -> None:
    victim = nodes.agents[1]
    key = nodes.store.keys.node(victim.name)
    before = await nodes.record(victim.name)
    assert before is not None
    if damage == "delete":
        assert await nodes.store.delete(key)
    else:
        await nodes.store.put_raw(key, GARBAGE)

    async def back() -> bool:
        return await nodes.record(victim.name) is not None

    damaged_at = time.monotonic()
    # Fine polling: the time it took is the measurement.
    await eventually(back, f"{victim.name}'s record written again after {damage}", TTL_S, max_delay_s=0.05)
    took = time.monotonic() - damaged_at
    restored = await nodes.record(victim.name)
    assert restored is not None
    assert (restored.ip_address, restored.clique_id, [g.uuid for g in restored.gpus]) == (
        before.ip_address,
        before.clique_id,
        [g.uuid for g in before.gpus],
    )
    await eventually(nodes.fits, "a Place on both nodes fits again", 2.0)
    assert await check_inventory(nodes.store, nodes.names) == []

    # The agent says what happened, naming the problem.
    await eventually(
        lambda: _logged(victim, "node record lost from the store; writing it again", problem),
        "the agent logs the lost record and why",
        5.0,
    )
    assert victim.running and took < TTL_S


async def test_a_stale_record_without_the_lease_is_replaced(nodes: Nodes) -> None:
    """A restore from an older backup: another address, no lease (it would outlive the agent)."""
    victim = nodes.agents[0]
    key = nodes.store.keys.node(victim.name)
    current = await nodes.record(victim.name)
    assert current is not None
    stale = pb.Node().parse(bytes(current))
    stale.ip_address, stale.registered_unix_ms = "127.9.9.9", 1
    await nodes.store.put(key, stale)

    async def ours_again() -> bool:
        item = await nodes.store.get(key, pb.Node)
        return item is not None and item.lease != 0 and item.value.ip_address == current.ip_address

    await eventually(ours_again, "the agent's own record, on its lease, replaces the stale one", TTL_S)


async def test_the_checker_flags_a_live_node_missing_from_the_inventory(nodes: Nodes) -> None:
    """Frozen (alive, but not running) the agent cannot heal: the absence is visible to placement
    and to the checker; running again, it writes the record back and both clear."""
    victim = nodes.agents[1]
    victim_process = victim.process
    assert victim_process is not None
    assert await check_inventory(nodes.store, nodes.names) == []
    victim_process.send_signal(signal.SIGSTOP)
    try:
        # Well within the lease: it is not lost, only its record is gone.
        await nodes.store.put_raw(nodes.store.keys.node(victim.name), GARBAGE)
        reason = await eventually(nodes.place_all, "the advisor to refuse a Place on both nodes", 2.0)
        assert reason == Reason.NO_CAPACITY
        violations = await check_inventory(nodes.store, nodes.names)
        assert len(violations) == 1 and victim.name in violations[0] and violations[0].startswith("inv7:")
    finally:
        victim_process.send_signal(signal.SIGCONT)

    async def clean() -> bool:
        return await check_inventory(nodes.store, nodes.names) == []

    await eventually(clean, "the record is back once the agent runs", TTL_S)
    await eventually(nodes.fits, "a Place on both nodes fits again", 2.0)


async def test_readiness_is_closed_while_the_record_cannot_be_written_again(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the store refuses the rewrite, health says the record is missing and why."""
    cluster = ClusterDescription(racks=1, seed="heal-health")
    name = cluster.node_name(0, 0)
    prepare_node_dirs(cluster, name, tmp_path)
    hardware = SimulatedNodeHardware(cluster, name, tmp_path / name, poll_interval=0.05)
    inventory = NodeRecordKeeper(store, name, hardware, RecordKeeperSettings(lease_ttl_s=TTL_S))
    health = inventory.health = Health()
    task = asyncio.create_task(inventory.run())
    try:
        await inventory.wait_registered(10.0)
        assert health.ready_gates == {"registered": True}
        refused = asyncio.Event()
        real_put = store.put

        async def refusing_put(key: str, value: object, lease: int = 0) -> int:
            if not refused.is_set():
                raise PermissionError("etcdserver: permission denied")
            return await real_put(key, value, lease)  # type: ignore[arg-type]

        monkeypatch.setattr(store, "put", refusing_put)
        assert await store.delete(store.keys.node(name))

        async def reported() -> bool:
            return health.ready_gates.get(
                "registered"
            ) is False and "missing (deleted)" in health.warnings.get("node-record", "")

        await eventually(reported, "readiness closed with the reason", TTL_S)
        assert not health.ready and not inventory.registered
        refused.set()

        async def healed() -> bool:
            return health.ready and await store.get(store.keys.node(name), pb.Node) is not None

        await eventually(healed, "the record is back and readiness open again", TTL_S)
        assert "node-record" not in health.warnings and inventory.rewrites >= 1
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        hardware.close()
