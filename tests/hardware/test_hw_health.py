"""Health event stream: what counts as a change, and how query failures are reported."""

from __future__ import annotations

import asyncio
import dataclasses

from libs.hardware.errors import HardwareError
from libs.hardware.health import diff_snapshots, poll_health_events
from libs.hardware.interface import HardwareSnapshot
from libs.hardware.model import FabricInfo, FabricState, GpuHealth, GpuInfo

CLUSTER = "7c9e6679-7425-40de-944b-e07fc1f90ae7"


def snapshot(*fabrics: FabricInfo) -> HardwareSnapshot:
    return HardwareSnapshot.of(tuple(GpuInfo(f"GPU-{i}", i, 1, f) for i, f in enumerate(fabrics)))


HEALTHY = FabricInfo(CLUSTER, 3, FabricState.COMPLETED)


def test_identical_snapshots_have_no_changes() -> None:
    assert diff_snapshots(snapshot(HEALTHY, HEALTHY), snapshot(HEALTHY, HEALTHY)) == ()


def test_memory_is_not_a_health_change() -> None:
    old = snapshot(HEALTHY)
    new = HardwareSnapshot.of((dataclasses.replace(old.gpus[0], memory_bytes=2),))
    assert diff_snapshots(old, new) == ()


def test_state_and_clique_changes_are_described() -> None:
    pending = dataclasses.replace(HEALTHY, state=FabricState.IN_PROGRESS)
    changes = diff_snapshots(snapshot(HEALTHY, HEALTHY), snapshot(HEALTHY, pending))
    assert "GPU-1 (GPU 1): fabric state COMPLETED -> IN_PROGRESS" in changes
    assert any(c.startswith(f"clique Fabric '{CLUSTER}.3' -> Pending ''") for c in changes)


def test_lost_gpu_is_a_change() -> None:
    changes = diff_snapshots(snapshot(HEALTHY, HEALTHY), snapshot(HEALTHY))
    assert "GPU-1 (GPU 1): gone" in changes


async def test_failed_query_is_reported_once_then_recovery() -> None:
    good = snapshot(HEALTHY)
    degraded = snapshot(dataclasses.replace(HEALTHY, health=GpuHealth.DEGRADED))
    script: list[HardwareSnapshot | Exception] = [
        HardwareError("GPU is lost"),
        HardwareError("GPU is lost"),
        HardwareError("GPU is lost"),
        good,
        good,
        degraded,
    ]

    def read() -> HardwareSnapshot:
        item = script.pop(0) if script else degraded
        if isinstance(item, Exception):
            raise item
        return item

    events = poll_health_events(read, interval=0.001, since=good)
    async with asyncio.timeout(5):
        failed = await anext(events)
        recovered = await anext(events)
        changed = await anext(events)
    assert failed.error == "GPU is lost" and failed.snapshot == good
    assert recovered.error == "" and recovered.changes == ("hardware query recovered",)
    assert changed.snapshot.health is GpuHealth.DEGRADED
    assert script == []  # the three failures were polled but reported only once
    await events.aclose()
