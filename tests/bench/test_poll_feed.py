"""The scale host's polled directory feeds: the stream a watch consumer expects, read in batches."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import pytest

from libs.gen.computedomain.state import v1 as pb
from libs.state.store import Store
from libs.state.watch import Resync, WatchEvent
from tools.sim.scalesim.poll_feed import PolledPrefix, PrefixPoller
from tools.sim.scalesim.watch_hub import WatchHub

Item = WatchEvent[pb.NodeBinding] | Resync[pb.NodeBinding]


def binding(node: str, domain: str) -> pb.NodeBinding:
    return pb.NodeBinding(node_name=node, domain_uid=domain)


async def next_item(stream: AsyncIterator[Item], timeout_s: float = 5.0) -> Item:
    async with asyncio.timeout(timeout_s):
        return await anext(stream)


async def test_a_polled_directory_starts_with_the_view_and_delivers_each_change(store: Store) -> None:
    keys = store.keys
    await store.put(keys.node_binding("a"), binding("a", "d1"))
    await store.put(keys.node_binding("b"), binding("b", "d1"))
    feed = PolledPrefix(store, keys.node_bindings(), pb.NodeBinding, interval_s=0.05)
    first = await next_item(feed)
    assert isinstance(first, Resync)
    assert {v.key: v.value.domain_uid for v in first.items} == {
        keys.node_binding("a"): "d1",
        keys.node_binding("b"): "d1",
    }

    await store.put(keys.node_binding("a"), binding("a", "d2"))
    await store.delete(keys.node_binding("b"))
    await store.put(keys.node_binding("c"), binding("c", "d3"))
    await store.put_raw(keys.node_binding("z"), b"\xff not a record")
    events = [await next_item(feed) for _ in range(4)]
    assert all(isinstance(e, WatchEvent) for e in events)
    by_key = {e.key: e for e in events if isinstance(e, WatchEvent)}
    assert by_key[keys.node_binding("a")].kind == "put" and by_key[keys.node_binding("a")].value == binding(
        "a", "d2"
    )
    assert by_key[keys.node_binding("b")].kind == "delete" and by_key[keys.node_binding("b")].value is None
    assert by_key[keys.node_binding("c")].value == binding("c", "d3")
    assert by_key[keys.node_binding("z")].kind == "undecodable"
    revisions = [e.revision for e in events if isinstance(e, WatchEvent)]
    assert revisions == sorted(revisions)
    # Each put carries the revision the store holds for that key.
    listed, _ = await store.list(keys.node_bindings(), pb.NodeBinding)
    assert {v.key: v.mod_revision for v in listed} == {
        k: e.revision for k, e in by_key.items() if e.kind == "put"
    }


async def test_a_key_changed_twice_between_two_reads_is_delivered_once_with_its_newest_state(
    store: Store,
) -> None:
    keys = store.keys
    # The first read comes 2 s after the listing: both writes land before it, even on a busy machine.
    feed = PolledPrefix(store, keys.node_bindings(), pb.NodeBinding, interval_s=2.0)
    assert isinstance(await next_item(feed), Resync)
    await store.put(keys.node_binding("a"), binding("a", "d1"))
    newest = await store.put(keys.node_binding("a"), binding("a", "d2"))
    event = await next_item(feed, timeout_s=10.0)
    assert isinstance(event, WatchEvent)
    assert (event.key, event.value, event.revision) == (keys.node_binding("a"), binding("a", "d2"), newest)
    with pytest.raises(TimeoutError):
        await next_item(feed, timeout_s=2.5)  # the next read finds nothing new: nothing is delivered


async def test_the_hub_reads_directories_with_the_directory_watch_on_its_own_client(store: Store) -> None:
    opened: list[tuple[str, str, Store]] = []

    def recording(kind: str) -> Callable[[Store, str, type[pb.NodeBinding]], AsyncGenerator[Item, None]]:
        def open_stream(client: Store, prefix: str, cls: type[pb.NodeBinding]) -> AsyncGenerator[Item, None]:
            opened.append((kind, prefix, client))

            async def stream() -> AsyncGenerator[Item, None]:
                yield Resync([], 1)
                await asyncio.Event().wait()

            return stream()

        return open_stream

    directory_client = Store(store.config)
    hub = WatchHub(
        open_watch=recording("watch"),  # type: ignore[arg-type]
        directory_watch=recording("directory"),  # type: ignore[arg-type]
        directory_store=directory_client,
    )
    directory = hub.watch(store, store.keys.members("d1"), pb.NodeBinding)
    single = hub.watch(store, store.keys.node_binding("n1"), pb.NodeBinding)
    try:
        await next_item(directory)
        await next_item(single)
        assert opened == [
            ("directory", store.keys.members("d1"), directory_client),
            ("watch", store.keys.node_binding("n1"), store),
        ]
    finally:
        await directory.aclose()
        await single.aclose()
        await hub.close()


def test_a_poll_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="poll interval"):
        PrefixPoller(0)
