"""A directory of the store followed by reading it at an interval: a watch coalesced in time.

The scale host's shared directory feeds (a domain's members, followed by every hosted member)
use this instead of an etcd watch. A watch stream hands the event loop one response per
revision, and a loaded host's loop takes one such turn every few tens of milliseconds: in a
256-pod formation the members feed ran up to 10 s behind the joins, and every hosted daemon
learnt its peers that late. One read returns every change since the last one in one response.
On a real node each agent watches on its own loop; this is the simulation's artefact and stays
in the simulation.

The stream has the semantics consumers of ``libs.state.watch.watch_prefix`` rely on: a `Resync`
(the whole view) first, then changes in revision order, each key's newest state. What it does
not give is every intermediate state of a key changed twice between two reads; consumers that
keep a view (as the IMEX supervisor does) cannot tell. A deletion carries the revision of the
read that found the key gone. Values are decoded only when their mod revision changed.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator

import structlog

from libs.runtime.backoff import Backoff
from libs.state.codec import UndecodableValue, decode
from libs.state.store import TRANSIENT_ERRORS, RawKV, Store
from libs.state.watch import M, Resync, WatchEvent

log = structlog.get_logger(__name__)


class PolledPrefix(AsyncIterator[WatchEvent[M] | Resync[M]]):
    """The prefix's Resync, then its changes, read every `interval_s`."""

    def __init__(self, store: Store, prefix: str, cls: type[M], interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"poll interval must be > 0, got {interval_s}")
        self.store, self.prefix, self.cls, self.interval_s = store, prefix, cls, interval_s
        # key -> mod revision of what was delivered (undecodable values included).
        self._known: dict[str, int] = {}
        self._pending: deque[WatchEvent[M]] = deque()
        self._started = False
        self._backoff = Backoff(initial=0.05, cap=2.0)

    def __aiter__(self) -> PolledPrefix[M]:
        return self

    async def __anext__(self) -> WatchEvent[M] | Resync[M]:
        if not self._started:
            self._started = True
            return await self._resync()
        while not self._pending:
            await asyncio.sleep(self.interval_s)
            self._pending.extend(await self._changes())
        return self._pending.popleft()

    async def _read(self) -> tuple[list[RawKV], int]:
        while True:
            try:
                result = await self.store.client.get_prefix(self.prefix.encode())
            except TRANSIENT_ERRORS as exc:
                delay = self._backoff.next_delay()
                log.warning(
                    "directory read failed; retrying", prefix=self.prefix, error=str(exc), retry_in_s=delay
                )
                await asyncio.sleep(delay)
                continue
            self._backoff.reset()
            kvs = [
                RawKV(kv.key.decode(), kv.value, kv.mod_revision, kv.create_revision, kv.lease)
                for kv in result
            ]
            return kvs, int(result.header.revision)

    async def _resync(self) -> Resync[M]:
        kvs, revision = await self._read()
        self._known = {kv.key: kv.mod_revision for kv in kvs}
        decoded = (self.store.decode_kv(kv, self.cls) for kv in kvs)  # undecodable: logged, left out
        return Resync([item for item in decoded if item is not None], revision)

    async def _changes(self) -> list[WatchEvent[M]]:
        kvs, revision = await self._read()
        events: list[WatchEvent[M]] = []
        for kv in kvs:
            if self._known.get(kv.key) == kv.mod_revision:
                continue
            self._known[kv.key] = kv.mod_revision
            try:
                events.append(WatchEvent("put", kv.key, decode(kv.value, self.cls, kv.key), kv.mod_revision))
            except UndecodableValue as exc:
                log.error("undecodable value written", key=kv.key, reason=exc.reason)
                events.append(WatchEvent("undecodable", kv.key, None, kv.mod_revision, exc.reason))
        present = {kv.key for kv in kvs}
        for key in [k for k in self._known if k not in present]:
            del self._known[key]
            events.append(WatchEvent("delete", key, None, revision))
        events.sort(key=lambda e: e.revision)
        return events


class PrefixPoller:
    """A ``PrefixWatcher`` (store, prefix, cls) whose streams read the prefix every `interval_s`."""

    def __init__(self, interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"poll interval must be > 0, got {interval_s}")
        self.interval_s = interval_s

    def __call__(self, store: Store, prefix: str, cls: type[M]) -> PolledPrefix[M]:
        return PolledPrefix(store, prefix, cls, self.interval_s)
