"""The async side of the fleet index (`fleet_index.py`, pure): the store watches that keep it
current, and waiting for it to change.

Three resumable prefix watches, each starting with a full listing: node records, node bindings
and reservation records. The index is ready once all three have listed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

import structlog

from libs.gen.computedomain.state import v1 as pb
from libs.runtime.cancellation import cancel_until_done
from libs.state.keys import Keys
from libs.state.store import Store, Versioned
from libs.state.watch import Resync, watch_prefix
from services.advisor.fleet_index import FleetIndex

log = structlog.get_logger(__name__)


def start_feeds(
    fleet: FleetIndex, store: Store, on_ready: Callable[[], None] | None = None
) -> list[asyncio.Task[None]]:
    """Start the three watch tasks that keep `fleet` current; stop them with `cancel_until_done`."""
    keys: Keys = store.keys

    def mark(source: str) -> None:
        was_ready = fleet.ready
        fleet.synced.add(source)
        if fleet.ready and not was_ready:
            log.info(
                "inventory synced",
                nodes=len(fleet.nodes),
                cliques=len(fleet.cliques),
                bound=len(fleet.bound),
                reservations=len(fleet.reservations),
            )
            if on_ready is not None:
                on_ready()

    async def nodes() -> None:
        async for item in watch_prefix(store, keys.nodes(), pb.Node):
            if isinstance(item, Resync):
                fleet.resync_nodes((Keys.last_segment(v.key), v.value) for v in item.items)
                mark("nodes")
            else:
                fleet.apply_node(Keys.last_segment(item.key), item.value)

    async def bindings() -> None:
        async for item in watch_prefix(store, keys.node_bindings(), pb.NodeBinding):
            if isinstance(item, Resync):
                fleet.resync_bindings((Keys.last_segment(v.key), v.value.domain_uid) for v in item.items)
                mark("bindings")
            else:
                node = Keys.last_segment(item.key)
                fleet.apply_binding(node, item.value.domain_uid if item.value is not None else None)

    async def reservations() -> None:
        feed = watch_prefix(store, keys.reservations(), pb.Reservation, fleet.skips_reservation_put)
        async for item in feed:
            if isinstance(item, Resync):
                fleet.resync_reservations(_reservation_items(item.items), item.revision)
                mark("reservations")
            else:
                fleet.apply_reservation_event(item)

    return [
        asyncio.create_task(nodes(), name="inventory-nodes"),
        asyncio.create_task(bindings(), name="inventory-bindings"),
        asyncio.create_task(reservations(), name="inventory-reservations"),
    ]


async def follow(fleet: FleetIndex, store: Store, on_ready: Callable[[], None] | None = None) -> None:
    """Keep `fleet` current from the store until cancelled (cancel once; it stops its watches)."""
    feeds = start_feeds(fleet, store, on_ready)
    try:
        done, _ = await asyncio.wait(feeds, return_when=asyncio.FIRST_EXCEPTION)
        for feed in done:
            feed.result()  # a feed only ends by failing: re-raise its error
        raise RuntimeError("inventory feed ended")
    finally:
        await cancel_until_done(feeds)


async def wait_changed(fleet: FleetIndex, since_generation: int, within_s: float | None = None) -> bool:
    """Wait until the index's generation moves past `since_generation`; False on timeout."""
    if fleet.generation > since_generation:
        return True
    changed = asyncio.Event()
    note = changed.set
    fleet.listeners.append(note)
    try:
        async with asyncio.timeout(within_s):
            while fleet.generation <= since_generation:
                await changed.wait()
                changed.clear()
    except TimeoutError:
        pass
    finally:
        fleet.listeners.remove(note)
    return fleet.generation > since_generation


async def wait_until(fleet: FleetIndex, predicate: Callable[[], bool], within_s: float) -> bool:
    """Wait until `predicate()` holds (re-checked after every change of the index); False on timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not predicate():
        remaining = deadline - loop.time()
        if remaining <= 0:
            return False
        await wait_changed(fleet, fleet.generation, remaining)
    return True


def _reservation_items(items: Iterable[Versioned[pb.Reservation]]) -> list[tuple[str, pb.Reservation, int]]:
    return [(Keys.last_segment(v.key), v.value, v.mod_revision) for v in items]
