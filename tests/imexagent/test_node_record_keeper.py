"""NodeRecordKeeper: the Node record on a kept lease, with a real etcd and simulated hardware."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from libs.gen.computedomain.state import v1 as pb
from libs.hardware import FabricState, GpuHealth, HardwareSnapshot
from libs.runtime.health import Health
from libs.state.node_record import clique_settled
from libs.state.store import Store
from services.imexagent.node_record_keeper import (
    NodeRecordKeeper,
    RecordKeeperSettings,
    build_node_record,
    node_address,
)
from tests.polling import eventually
from tools.sim.hardware.cluster import ClusterDescription
from tools.sim.hardware.simulated import SimulatedNodeHardware, prepare_node_dirs

# etcd grants at least ~2 s whatever is asked (its minimum lease TTL).
TTL_S = 2
SETTINGS = RecordKeeperSettings(
    lease_ttl_s=TTL_S,
    unsettled_retry_s=0.05,
    health_poll_interval_s=0.05,
    kubelet_dir="/var/lib/kubelet-test",
    cdi_root="/var/run/cdi-test",
)


def make_hardware(base: Path) -> SimulatedNodeHardware:
    cluster = ClusterDescription(racks=2, seed=uuid.uuid4().hex)
    prepare_node_dirs(cluster, "rack1-tray3", base)
    return SimulatedNodeHardware(cluster, "rack1-tray3", base / "rack1-tray3", poll_interval=0.05)


async def read_node(store: Store, name: str) -> pb.Node | None:
    item = await store.get(store.keys.node(name), pb.Node)
    return item.value if item else None


@contextlib.asynccontextmanager
async def running(keeper: NodeRecordKeeper) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(keeper.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.fixture
def hardware(tmp_path: Path) -> SimulatedNodeHardware:
    return make_hardware(tmp_path)


async def test_node_record_appears_on_a_lease(store: Store, hardware: SimulatedNodeHardware) -> None:
    keeper = NodeRecordKeeper(store, "rack1-tray3", hardware, SETTINGS)
    async with running(keeper):
        node = await keeper.wait_registered(5.0)
        item = await store.get(store.keys.node("rack1-tray3"), pb.Node)
        assert item is not None
        assert item.lease != 0 and item.lease == keeper.lease.lease_id
        stored = item.value
        sim = hardware.node
        assert stored.name == "rack1-tray3"
        assert stored.ip_address == sim.address == "127.1.1.4"
        assert stored.clique_id == sim.clique and stored.cluster_uuid == sim.cluster_uuid
        assert [g.uuid for g in stored.gpus] == [g.uuid for g in hardware.gpus()]
        assert all(g.fabric_state == pb.FabricState.COMPLETED for g in stored.gpus)
        assert stored.health == pb.Health.HEALTHY
        assert stored.driver_version == hardware.driver_version()
        assert stored.agent_version
        assert stored.kubelet_dir == "/var/lib/kubelet-test" and stored.cdi_root == "/var/run/cdi-test"
        assert stored.fabric_message == "" and stored.registered_unix_ms > 0
        assert node.clique_id == stored.clique_id


async def test_record_expires_within_the_ttl_when_the_agent_stops(
    store: Store, hardware: SimulatedNodeHardware
) -> None:
    keeper = NodeRecordKeeper(store, "rack1-tray3", hardware, SETTINGS)
    async with running(keeper):
        await keeper.wait_registered(5.0)
        await asyncio.sleep(TTL_S * 0.6)  # at least one keep-alive went through
    # The task is gone (no revoke, as after a crash): the record must still be there now ...
    assert await read_node(store, "rack1-tray3") is not None

    async def gone() -> bool:
        return await read_node(store, "rack1-tray3") is None

    # ... and vanish within one TTL (plus etcd's expiry check granularity of 0.5 s).
    started = time.monotonic()
    # Fine polling: the time it took is the measurement.
    await eventually(gone, "node record expired", TTL_S + 2.0, max_delay_s=0.05)
    took = time.monotonic() - started
    assert took <= TTL_S + 1.0, took


async def test_record_is_written_again_after_the_lease_is_lost(
    store: Store, hardware: SimulatedNodeHardware
) -> None:
    keeper = NodeRecordKeeper(store, "rack1-tray3", hardware, SETTINGS)
    async with running(keeper) as task:
        await keeper.wait_registered(5.0)
        first_lease = keeper.lease.lease_id
        assert first_lease is not None
        # The lease is lost (as when etcd expired it during a partition).
        await store.revoke_lease(first_lease)
        assert await read_node(store, "rack1-tray3") is None

        async def back_on_new_lease() -> bool:
            item = await store.get(store.keys.node("rack1-tray3"), pb.Node)
            return item is not None and item.lease not in (0, first_lease)

        await eventually(back_on_new_lease, "re-registered on a new lease", TTL_S + 3.0)
        assert keeper.lease.losses == 1
        assert not task.done()


async def test_health_events_update_the_record(store: Store, hardware: SimulatedNodeHardware) -> None:
    keeper = NodeRecordKeeper(store, "rack1-tray3", hardware, SETTINGS)
    async with running(keeper):
        await keeper.wait_registered(5.0)
        hardware.faults.set_health(GpuHealth.DEGRADED, gpu=2)

        async def degraded() -> bool:
            node = await read_node(store, "rack1-tray3")
            return node is not None and node.health == pb.Health.DEGRADED

        await eventually(degraded, "health DEGRADED in the store", 5.0)
        node = await read_node(store, "rack1-tray3")
        assert node is not None
        assert [g.health for g in node.gpus] == [
            pb.Health.HEALTHY,
            pb.Health.HEALTHY,
            pb.Health.DEGRADED,
            pb.Health.HEALTHY,
        ]
        assert keeper.node.health == pb.Health.DEGRADED


async def test_fabric_still_coming_up_is_reported_then_resolved(
    store: Store, hardware: SimulatedNodeHardware
) -> None:
    hardware.faults.set_fabric_state(FabricState.IN_PROGRESS, gpu=1)
    keeper = NodeRecordKeeper(store, "rack1-tray3", hardware, SETTINGS)
    async with running(keeper) as task:
        node = await keeper.wait_registered(5.0)
        assert node.clique_id == ""
        assert "IN_PROGRESS" in node.fabric_message
        assert not clique_settled(node)
        stored = await read_node(store, "rack1-tray3")
        assert stored is not None and "IN_PROGRESS" in stored.fabric_message
        assert stored.gpus[1].fabric_state == pb.FabricState.IN_PROGRESS

        hardware.faults.set_fabric_state(None, gpu=1)  # the fabric manager finished

        async def settled() -> bool:
            n = await read_node(store, "rack1-tray3")
            return n is not None and n.clique_id == hardware.node.clique and n.fabric_message == ""

        await eventually(settled, "clique settled in the store", 5.0)
        assert not task.done()


async def test_non_fabric_node_is_settled_without_a_clique(
    store: Store, hardware: SimulatedNodeHardware
) -> None:
    hardware.faults.set_non_fabric()
    keeper = NodeRecordKeeper(store, "rack1-tray3", hardware, SETTINGS)
    async with running(keeper):
        node = await keeper.wait_registered(5.0)
        assert node.clique_id == "" and node.cluster_uuid == "" and node.fabric_message == ""
        assert clique_settled(node)


async def test_changes_yields_the_record_as_it_changes(store: Store, hardware: SimulatedNodeHardware) -> None:
    keeper = NodeRecordKeeper(store, "rack1-tray3", hardware, SETTINGS)
    seen: list[pb.Node] = []

    async def follow() -> None:
        async for node in keeper.changes():
            seen.append(node)

    async with running(keeper):
        follower = asyncio.create_task(follow())
        try:
            await keeper.wait_registered(5.0)
            hardware.faults.set_fabric_state(FabricState.IN_PROGRESS)

            async def pending_seen() -> bool:
                return any("IN_PROGRESS" in n.fabric_message for n in seen)

            await eventually(pending_seen, "pending clique seen by changes()", 5.0)
            assert seen[-1].clique_id == ""
            assert any(n.clique_id == hardware.node.clique for n in seen)
        finally:
            follower.cancel()


def test_build_node_record_names_a_hardware_error(tmp_path: Path) -> None:
    hardware = make_hardware(tmp_path)
    snapshot: HardwareSnapshot = hardware.snapshot()
    node = build_node_record("n", "10.0.0.1", snapshot, "570", SETTINGS, hardware_error="NVML gone")
    assert node.health == pb.Health.UNKNOWN
    assert "hardware query failed: NVML gone" in node.fabric_message
    assert node.clique_id == hardware.node.clique  # the last good snapshot still names it
    never_read = build_node_record("n", "10.0.0.1", None, "", SETTINGS, hardware_error="no driver")
    assert never_read.gpus == [] and not clique_settled(never_read)


def test_node_address_needs_configuration_on_real_hardware(tmp_path: Path) -> None:
    hardware = make_hardware(tmp_path)
    assert node_address(hardware, "") == hardware.node.address
    assert node_address(hardware, "10.1.2.3") == "10.1.2.3"

    class RealLike:
        imex_backend = "nvidia"

    with pytest.raises(ValueError, match="--node-ip"):
        node_address(RealLike(), "")  # type: ignore[arg-type]


class HangingHardware(SimulatedNodeHardware):
    """Simulated hardware whose snapshot blocks, as an NVML call stuck in the driver would."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.hang = threading.Event()
        self.release = threading.Event()

    def snapshot(self) -> HardwareSnapshot:
        if self.hang.is_set():
            self.release.wait(30)
        return super().snapshot()


async def test_a_hung_hardware_query_is_reported_and_stops_neither_the_loop_nor_the_lease(
    store: Store, tmp_path: Path
) -> None:
    cluster = ClusterDescription(racks=2, seed=uuid.uuid4().hex)
    prepare_node_dirs(cluster, "rack1-tray3", tmp_path)
    hardware = HangingHardware(cluster, "rack1-tray3", tmp_path / "rack1-tray3", poll_interval=0.05)
    settings = replace(SETTINGS, hardware_query_timeout_s=0.5)
    keeper = NodeRecordKeeper(store, "rack1-tray3", hardware, settings)
    health = Health()
    keeper.health = health
    key = store.keys.node("rack1-tray3")
    async with running(keeper):
        await keeper.wait_registered(5.0)
        lease = keeper.lease.lease_id
        hardware.hang.set()

        async def stall_reported() -> bool:
            node = await read_node(store, "rack1-tray3")
            return node is not None and "hung driver" in node.fabric_message and "hardware" in health.warnings

        await eventually(stall_reported, "the stall in the record and on /healthz", 5.0)
        assert health.healthy, "a hung driver is a warning, not a liveness failure"
        # Three lease TTLs into the stall: the record never went away, the loop kept its pace.
        lags: list[float] = []
        deadline = time.monotonic() + 3 * TTL_S
        while time.monotonic() < deadline:
            before = time.monotonic()
            await asyncio.sleep(0.05)
            lags.append(time.monotonic() - before - 0.05)
            item = await store.get(key, pb.Node)
            assert item is not None and item.lease == lease, "the node record must stay on its lease"
        assert max(lags) < 0.25, f"event loop stalled {max(lags):.2f}s"
        hardware.release.set()
        hardware.hang.clear()

        async def recovered() -> bool:
            node = await read_node(store, "rack1-tray3")
            return node is not None and node.fabric_message == "" and "hardware" not in health.warnings

        await eventually(recovered, "recovery once the query returns", 5.0)
