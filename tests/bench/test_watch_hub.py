"""The scale host's shared watches: every subscriber sees what its own store watch would show."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from libs.gen.computedomain.state import v1 as pb
from libs.state.store import Put, Store
from libs.state.watch import Resync, WatchEvent
from tools.sim.scalesim.watch_hub import WatchHub

Item = WatchEvent[pb.NodeBinding] | Resync[pb.NodeBinding]


def binding(node: str, domain: str) -> pb.NodeBinding:
    return pb.NodeBinding(node_name=node, domain_uid=domain)


async def next_item(stream: AsyncGenerator[Item, None], timeout_s: float = 5.0) -> Item:
    async with asyncio.timeout(timeout_s):
        return await anext(stream)


def view_after(items: list[Item]) -> dict[str, str]:
    """What a consumer that replaces its view on Resync and applies events holds."""
    view: dict[str, str] = {}
    for item in items:
        if isinstance(item, Resync):
            view = {v.key: v.value.domain_uid for v in item.items}
        elif item.value is None:
            view.pop(item.key, None)
        else:
            view[item.key] = item.value.domain_uid
    return view


async def test_subscribers_of_one_prefix_share_one_watch_and_see_every_change(store: Store) -> None:
    hub = WatchHub()
    prefix = store.keys.node_bindings()
    await store.put(store.keys.node_binding("a"), binding("a", "d1"))
    first = hub.watch(store, prefix, pb.NodeBinding)
    second = hub.watch(store, prefix, pb.NodeBinding)
    try:
        got_first = [await next_item(first)]
        got_second = [await next_item(second)]
        assert hub.feeds == 1
        assert isinstance(got_first[0], Resync) and isinstance(got_second[0], Resync)
        await store.put(store.keys.node_binding("b"), binding("b", "d2"))
        await store.delete(store.keys.node_binding("a"))
        for stream, got in ((first, got_first), (second, got_second)):
            got += [await next_item(stream), await next_item(stream)]
            assert view_after(got) == {store.keys.node_binding("b"): "d2"}
    finally:
        await first.aclose()
        await second.aclose()
    assert hub.feeds == 0  # the last subscriber gone, the underlying watch ends
    await hub.close()


async def test_a_late_subscriber_starts_from_the_current_view_even_mid_transaction(store: Store) -> None:
    hub = WatchHub()
    prefix = store.keys.node_bindings()
    early = hub.watch(store, prefix, pb.NodeBinding)
    try:
        await next_item(early)
        # Two keys written by one transaction share one revision.
        await store.txn(
            [],
            [
                Put(store.keys.node_binding("x"), binding("x", "d")),
                Put(store.keys.node_binding("y"), binding("y", "d")),
            ],
        )
        await next_item(early)  # the feed has applied x, and maybe not y yet
        late = hub.watch(store, prefix, pb.NodeBinding)
        got = [await next_item(late)]
        assert isinstance(got[0], Resync)
        while len(view_after(got)) < 2:
            got.append(await next_item(late, timeout_s=2.0))
        assert view_after(got) == {store.keys.node_binding("x"): "d", store.keys.node_binding("y"): "d"}
        resync = got[0]
        assert all(v.create_revision == v.mod_revision for v in resync.items)  # created by that write
        await late.aclose()
    finally:
        await early.aclose()
        await hub.close()


async def test_subscribers_of_different_prefixes_see_only_their_own(store: Store) -> None:
    hub = WatchHub()
    mine = hub.watch(store, store.keys.node_binding("n1"), pb.NodeBinding)
    other = hub.watch(store, store.keys.node_binding("n2"), pb.NodeBinding)
    try:
        assert isinstance(await next_item(mine), Resync)
        assert isinstance(await next_item(other), Resync)
        assert hub.feeds == 2
        await store.put(store.keys.node_binding("n2"), binding("n2", "d"))
        await store.put(store.keys.node_binding("n1"), binding("n1", "d"))
        event = await next_item(mine)
        assert isinstance(event, WatchEvent) and event.key == store.keys.node_binding("n1")
    finally:
        await mine.aclose()
        await other.aclose()
        await hub.close()


async def test_a_subscriber_joining_between_two_events_of_one_revision_gets_both() -> None:
    # The store delivers a transaction's keys as separate events with one revision; a
    # subscriber whose snapshot holds the first must still get the second.
    release = asyncio.Event()
    key_x, key_y = "/p/nodebindings/x", "/p/nodebindings/y"

    def scripted(store: Store, prefix: str, cls: type[pb.NodeBinding]) -> AsyncGenerator[Item, None]:
        async def events() -> AsyncGenerator[Item, None]:
            yield Resync([], 1)
            yield WatchEvent("put", key_x, binding("x", "d"), 2)
            await release.wait()
            yield WatchEvent("put", key_y, binding("y", "d"), 2)
            await asyncio.Event().wait()  # a watch does not end

        return events()

    hub = WatchHub(open_watch=scripted)
    early = hub.watch(None, "/p/nodebindings/", pb.NodeBinding)  # type: ignore[arg-type]
    try:
        seen_early = [await next_item(early)]
        while key_x not in view_after(seen_early):
            seen_early.append(await next_item(early))
        late = hub.watch(None, "/p/nodebindings/", pb.NodeBinding)  # type: ignore[arg-type]
        snapshot = await next_item(late)
        assert isinstance(snapshot, Resync) and [v.key for v in snapshot.items] == [key_x]
        release.set()
        got = [snapshot, await next_item(late)]
        assert view_after(got) == {key_x: "d", key_y: "d"}
        seen_early.append(await next_item(early))
        assert view_after(seen_early) == {key_x: "d", key_y: "d"}
        await late.aclose()
    finally:
        await early.aclose()
        await hub.close()
