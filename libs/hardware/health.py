"""Turn periodic hardware snapshots into health events (pure diff + cancellable poll loop)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

import structlog

from libs.hardware.errors import HardwareError
from libs.hardware.interface import HardwareSnapshot, HealthEvent
from libs.hardware.model import GpuInfo
from libs.hardware.off_loop import OffLoopCalls

log = structlog.get_logger(__name__)

MAX_ERROR_BACKOFF_FACTOR = 8
"""While queries fail, the poll interval doubles up to this many times the normal interval."""
DEFAULT_QUERY_TIMEOUT_S = 10.0
"""How long one hardware snapshot may take before it counts as a failed (stalled) query."""


def _gpu_changes(old: GpuInfo, new: GpuInfo) -> list[str]:
    name = f"{new.uuid} (GPU {new.index})"
    changes = []
    if old.fabric.state != new.fabric.state:
        changes.append(f"{name}: fabric state {old.fabric.state.name} -> {new.fabric.state.name}")
    if old.fabric.health != new.fabric.health:
        changes.append(f"{name}: health {old.fabric.health.label} -> {new.fabric.health.label}")
    if (old.fabric.cluster_uuid, old.fabric.clique_id) != (new.fabric.cluster_uuid, new.fabric.clique_id):
        changes.append(
            f"{name}: fabric {old.fabric.cluster_uuid}.{old.fabric.clique_id} -> "
            f"{new.fabric.cluster_uuid}.{new.fabric.clique_id}"
        )
    if old.fabric.status != new.fabric.status:
        changes.append(f"{name}: fabric status {old.fabric.status} -> {new.fabric.status}")
    return changes


def diff_snapshots(old: HardwareSnapshot, new: HardwareSnapshot) -> tuple[str, ...]:
    """Human-readable differences that matter to the node's health or clique; () if none."""
    changes: list[str] = []
    old_by_uuid = {g.uuid: g for g in old.gpus}
    new_by_uuid = {g.uuid: g for g in new.gpus}
    for uuid, gpu in old_by_uuid.items():
        if uuid not in new_by_uuid:
            changes.append(f"{uuid} (GPU {gpu.index}): gone")
    for uuid, gpu in new_by_uuid.items():
        before = old_by_uuid.get(uuid)
        if before is None:
            changes.append(f"{uuid} (GPU {gpu.index}): appeared")
        else:
            changes.extend(_gpu_changes(before, gpu))
    if old.clique != new.clique:
        changes.append(
            f"clique {old.clique.status.value} {old.clique.clique_id!r} -> "
            f"{new.clique.status.value} {new.clique.clique_id!r}: {new.clique.reason}"
        )
    return tuple(changes)


async def poll_health_events(
    read: Callable[[], HardwareSnapshot],
    interval: float,
    since: HardwareSnapshot | None = None,
    calls: OffLoopCalls | None = None,
) -> AsyncGenerator[HealthEvent, None]:
    """Poll ``read`` every ``interval`` seconds and yield an event for each change.

    ``read`` runs off the event loop through `calls` (default: a deadline of
    ``DEFAULT_QUERY_TIMEOUT_S``), so a hung driver is a failing read (`HardwareStalled`), not a
    stopped loop. A failing ``read`` is reported once per failure streak (then polled with capped
    backoff); the first good read after it always yields an event (changes relative to the last
    good snapshot).
    """
    calls = calls or OffLoopCalls(DEFAULT_QUERY_TIMEOUT_S)
    last = since if since is not None else await calls.call(read, "snapshot")
    failing = False
    delay = interval
    while True:
        await asyncio.sleep(delay)
        try:
            current = await calls.call(read, "snapshot")
        except HardwareError as exc:
            delay = min(delay * 2, interval * MAX_ERROR_BACKOFF_FACTOR)
            if not failing:
                failing = True
                log.warning("hardware query failed", error=str(exc))
                yield HealthEvent(snapshot=last, changes=(f"hardware query failed: {exc}",), error=str(exc))
            continue
        delay = interval
        changes = diff_snapshots(last, current)
        if failing:
            # The consumer saw an error event; tell it the error is over even if nothing changed.
            failing = False
            log.info("hardware query recovered")
            changes = ("hardware query recovered", *changes)
        if changes:
            last = current
            yield HealthEvent(snapshot=current, changes=changes)
