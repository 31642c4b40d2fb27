"""The store watches that keep the advisor's inventory current (the inventory itself is pure).

Three resumable prefix watches, each starting with a full listing: node records, node bindings
and reservation records. The inventory is ready once all three have listed.
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
from services.advisor.inventory import Inventory

log = structlog.get_logger(__name__)


def start_feeds(
    inventory: Inventory, store: Store, on_ready: Callable[[], None] | None = None
) -> list[asyncio.Task[None]]:
    """Start the three watch tasks that keep `inventory` current; stop them with `cancel_until_done`."""
    keys: Keys = store.keys

    def mark(source: str) -> None:
        was_ready = inventory.ready
        inventory.synced.add(source)
        if inventory.ready and not was_ready:
            log.info(
                "inventory synced",
                nodes=len(inventory.nodes),
                cliques=len(inventory.cliques),
                bound=len(inventory.bound),
                reservations=len(inventory.reservations),
            )
            if on_ready is not None:
                on_ready()

    async def nodes() -> None:
        async for item in watch_prefix(store, keys.nodes(), pb.Node):
            if isinstance(item, Resync):
                inventory.resync_nodes((Keys.last_segment(v.key), v.value) for v in item.items)
                mark("nodes")
            else:
                inventory.apply_node(Keys.last_segment(item.key), item.value)

    async def bindings() -> None:
        async for item in watch_prefix(store, keys.node_bindings(), pb.NodeBinding):
            if isinstance(item, Resync):
                inventory.resync_bindings((Keys.last_segment(v.key), v.value.domain_uid) for v in item.items)
                mark("bindings")
            else:
                node = Keys.last_segment(item.key)
                inventory.apply_binding(node, item.value.domain_uid if item.value is not None else None)

    async def reservations() -> None:
        feed = watch_prefix(store, keys.reservations(), pb.Reservation, inventory.skips_reservation_put)
        async for item in feed:
            if isinstance(item, Resync):
                inventory.resync_reservations(_reservation_items(item.items), item.revision)
                mark("reservations")
            else:
                inventory.apply_reservation_event(item)

    return [
        asyncio.create_task(nodes(), name="inventory-nodes"),
        asyncio.create_task(bindings(), name="inventory-bindings"),
        asyncio.create_task(reservations(), name="inventory-reservations"),
    ]


async def follow(inventory: Inventory, store: Store, on_ready: Callable[[], None] | None = None) -> None:
    """Keep `inventory` current from the store until cancelled (cancel once; it stops its watches)."""
    feeds = start_feeds(inventory, store, on_ready)
    try:
        done, _ = await asyncio.wait(feeds, return_when=asyncio.FIRST_EXCEPTION)
        for feed in done:
            feed.result()  # a feed only ends by failing: re-raise its error
        raise RuntimeError("inventory feed ended")
    finally:
        await cancel_until_done(feeds)


def _reservation_items(items: Iterable[Versioned[pb.Reservation]]) -> list[tuple[str, pb.Reservation, int]]:
    return [(Keys.last_segment(v.key), v.value, v.mod_revision) for v in items]
