"""One store watch per prefix for all hosted agents, decoded once, delivered to each subscriber.

Every member of a domain watches ``members/<domain>/``. On real nodes that is one stream per node;
with 256 agents in one process it would be 256 etcd watches delivering, and 256 decodes of, each
of the domain's member changes, so a 256-node formation would cost ~65,000 decodes on one core
(the simulation's artefact, not the product's: each real node decodes only its own 256).
`WatchHub.watch` has the signature of ``libs.state.watch.watch_prefix`` and the same stream
semantics: a `Resync` (the complete current view) first, then every change in revision order, and
a new `Resync` whenever the underlying watch had to list again. Subscribers of one prefix share
one `PrefixWatch`; a late subscriber's first `Resync` is the feed's view at its last revision
(consistent: every later event has a higher revision). Values are shared between subscribers and
must not be mutated (the node agent's supervisor only reads them).

The view of a key first seen through an event has ``lease=0`` (watch events do not carry it);
its create revision is tracked exactly (a put of a new key creates it at that revision).

A feed of a directory (a prefix ending in ``/``, such as a domain's members) can be opened
differently (`directory_watch`, e.g. `tools.sim.scalesim.poll_feed.PrefixPoller`) and on a client of its
own (`directory_store`). A client's watch stream hands the event loop one response at a time, so
on a loaded host it drains a few dozen a second; the members feed of a 256-node domain carries
hundreds in a burst, and the single-key watches sharing its stream (a node's binding, its daemon's
status: what a prepare waits for) waited behind them for up to 15 s in a 256-pod formation.
Per-node keys stay on the subscriber's client, watched.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterable
from typing import Any, Generic

import betterproto
import structlog

from libs.state.store import Store, Versioned
from libs.state.watch import M, PrefixWatcher, Resync, WatchEvent, watch_prefix

log = structlog.get_logger(__name__)

Item = WatchEvent[Any] | Resync[Any]


class _Feed(Generic[M]):
    """One underlying watch, its current view, and the subscribers' queues."""

    def __init__(self, source: AsyncIterable[WatchEvent[M] | Resync[M]], prefix: str, on_idle: Any) -> None:
        self.prefix = prefix
        self.view: dict[str, Versioned[M]] = {}
        self.revision = 0
        # Items delivered so far: a subscriber skips queued items its snapshot already holds
        # (revisions cannot tell: the events of one transaction share one).
        self.sequence = 0
        self.synced = asyncio.Event()
        self.subscribers: set[asyncio.Queue[tuple[int, WatchEvent[M] | Resync[M]]]] = set()
        self._on_idle = on_idle
        self._task = asyncio.create_task(self._pump(source), name=f"watchhub-{prefix}")

    async def _pump(self, source: AsyncIterable[WatchEvent[M] | Resync[M]]) -> None:
        async for item in source:
            if isinstance(item, Resync):
                self.view = {v.key: v for v in item.items}
            elif item.value is None:
                self.view.pop(item.key, None)
            else:
                previous = self.view.get(item.key)
                created = previous.create_revision if previous is not None else item.revision
                self.view[item.key] = Versioned(item.key, item.value, item.revision, created)
            self.revision = item.revision
            self.sequence += 1
            self.synced.set()
            for queue in self.subscribers:
                queue.put_nowait((self.sequence, item))

    def snapshot(self) -> Resync[M]:
        return Resync(sorted(self.view.values(), key=lambda v: v.key), self.revision)

    def unsubscribe(self, queue: asyncio.Queue[tuple[int, WatchEvent[M] | Resync[M]]]) -> None:
        self.subscribers.discard(queue)
        if not self.subscribers:
            self._task.cancel()
            self._on_idle(self)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


class WatchHub:
    """Shared prefix watches; `watch` is a drop-in for ``libs.state.watch.watch_prefix``."""

    def __init__(
        self,
        open_watch: PrefixWatcher = watch_prefix,
        directory_watch: PrefixWatcher | None = None,
        directory_store: Store | None = None,
    ) -> None:
        self._open_watch = open_watch
        self._directory_watch = directory_watch or open_watch
        self._directory_store = directory_store
        self._feeds: dict[tuple[str, type[betterproto.Message]], _Feed[Any]] = {}

    @property
    def feeds(self) -> int:
        return len(self._feeds)

    def watch(
        self, store: Store, prefix: str, cls: type[M]
    ) -> AsyncGenerator[WatchEvent[M] | Resync[M], None]:
        return self._subscribe(store, prefix, cls)

    async def _subscribe(
        self, store: Store, prefix: str, cls: type[M]
    ) -> AsyncGenerator[WatchEvent[M] | Resync[M], None]:
        key = (prefix, cls)
        feed: _Feed[M] | None = self._feeds.get(key)
        if feed is None:
            if prefix.endswith("/"):
                source = self._directory_watch(self._directory_store or store, prefix, cls)
            else:
                source = self._open_watch(store, prefix, cls)
            feed = _Feed(source, prefix, lambda f: self._forget(key, f))
            self._feeds[key] = feed
        queue: asyncio.Queue[tuple[int, WatchEvent[M] | Resync[M]]] = asyncio.Queue()
        feed.subscribers.add(queue)
        try:
            await feed.synced.wait()
            seen = feed.sequence  # what was queued up to here is in the snapshot
            yield feed.snapshot()
            while True:
                sequence, item = await queue.get()
                if sequence > seen:
                    yield item
        finally:
            feed.unsubscribe(queue)

    def _forget(self, key: tuple[str, type[betterproto.Message]], feed: _Feed[Any]) -> None:
        if self._feeds.get(key) is feed:
            del self._feeds[key]

    async def close(self) -> None:
        feeds, self._feeds = list(self._feeds.values()), {}
        for feed in feeds:
            await feed.close()
