"""A watch over a key prefix that survives etcd restarts and compaction.

The stream starts with a `Resync` (a full listing at some revision), then
yields `WatchEvent`s in revision order. After a connection loss it resumes
from the last revision it delivered, so nothing is lost or repeated. If that
revision has been compacted away it lists again and yields a new `Resync`:
consumers treat a Resync as "replace your view", which keeps them
level-triggered.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Generic, Literal, Protocol, TypeVar

import aetcd.exceptions
import aetcd.rtypes
import aetcd.utils
import betterproto
import structlog

from libs.runtime.backoff import Backoff
from libs.state.codec import UndecodableValue, decode
from libs.state.store import TRANSIENT_ERRORS, Store, Versioned

log = structlog.get_logger(__name__)

M = TypeVar("M", bound=betterproto.Message)


@dataclass(frozen=True, slots=True)
class WatchEvent(Generic[M]):
    """One change under the prefix. ``undecodable``: a value was written that this build cannot
    read (`reason` says why). Its `value` is None, so a view drops the key, as a listing does;
    a consumer that must tell it from a deletion checks `kind`."""

    kind: Literal["put", "delete", "undecodable"]
    key: str
    # None for a delete and for an undecodable value.
    value: M | None
    revision: int
    reason: str = ""


def put_event(key: str, revision: int, value: bytes, cls: type[M]) -> WatchEvent[M]:
    """A put as the watch delivers it: decoded, or "undecodable" (logged) when it cannot be read.
    Also for a consumer that took a put's raw value over (`PrefixWatch.known`) and applies it later."""
    try:
        decoded = decode(value, cls, key)
    except UndecodableValue as exc:
        log.error("undecodable value written", key=key, reason=exc.reason)
        return WatchEvent("undecodable", key, None, revision, exc.reason)
    return WatchEvent("put", key, decoded, revision)


@dataclass(frozen=True, slots=True)
class Resync(Generic[M]):
    items: list[Versioned[M]]
    revision: int


class PrefixWatch(Generic[M]):
    """Async iterator of Resync / WatchEvent for one prefix; cancel the consuming task to stop."""

    def __init__(
        self,
        store: Store,
        prefix: str,
        cls: type[M],
        backoff: Backoff | None = None,
        known: Callable[[str, int, bytes], bool] | None = None,
    ) -> None:
        self.store = store
        self.prefix = prefix
        # known(key, revision, value): the consumer holds this put already (it wrote it), or takes
        # its raw value over: skip it undecoded.
        self.known = known
        self.cls = cls
        self.backoff = backoff or Backoff(initial=0.05, cap=2.0)
        # Last revision delivered to the consumer.
        self.revision = 0
        self.reconnects = 0
        self.resyncs = 0

    async def _resync(self) -> Resync[M]:
        while True:
            try:
                items, revision = await self.store.list(self.prefix, self.cls)
                self.revision = revision
                self.resyncs += 1
                self.backoff.reset()
                return Resync(items, revision)
            except TRANSIENT_ERRORS as exc:
                delay = self.backoff.next_delay()
                log.warning(
                    "watch list failed; retrying",
                    prefix=self.prefix,
                    error=str(exc),
                    retry_in_s=round(delay, 3),
                )
                await asyncio.sleep(delay)

    def _to_event(self, raw: aetcd.rtypes.Event) -> WatchEvent[M]:
        key = raw.kv.key.decode()
        revision = int(raw.kv.mod_revision)
        if raw.kind == aetcd.rtypes.EventKind.DELETE:
            return WatchEvent("delete", key, None, revision)
        return put_event(key, revision, raw.kv.value, self.cls)

    async def __aiter__(self) -> AsyncIterator[WatchEvent[M] | Resync[M]]:
        yield await self._resync()
        while True:
            # aetcd creates watches under asyncio.wait_for, which on Python 3.11 can
            # swallow a cancellation; a pending cancel request must still stop us.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise asyncio.CancelledError
            watch = None
            try:
                watch = await _create_watch(self.store, self.prefix, self.revision + 1)
                if task is not None and task.cancelling():
                    raise asyncio.CancelledError
                self.backoff.reset()
                prefix_bytes = self.prefix.encode()
                async for raw in watch:
                    if not raw.kv.key.startswith(prefix_bytes):
                        # aetcd can hand a new watch the events of one cancelled while
                        # it was being created: this stream is not ours. Re-watch from
                        # the last delivered revision; nothing is lost.
                        log.warning(
                            "watch received a foreign key; re-watching",
                            prefix=self.prefix,
                            key=raw.kv.key.decode(errors="replace"),
                        )
                        self.reconnects += 1
                        break
                    # One transaction gives several events of the same revision: only
                    # older revisions are repeats (resuming from revision+1 never
                    # replays, and etcd sends a revision's events in one response).
                    revision = int(raw.kv.mod_revision)
                    if revision < self.revision:
                        continue
                    self.revision = revision
                    if (
                        self.known is not None
                        and raw.kind != aetcd.rtypes.EventKind.DELETE
                        and self.known(raw.kv.key.decode(), revision, raw.kv.value)
                    ):
                        continue
                    yield self._to_event(raw)
                # The iterator ends only when the watch was cancelled under us: re-watch.
            except aetcd.exceptions.RevisionCompactedError as exc:
                log.warning(
                    "watch revision compacted; listing again",
                    prefix=self.prefix,
                    compacted=exc.compacted_revision,
                )
                yield await self._resync()
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # stream broke: etcd restarted, network, ...
                self.reconnects += 1
                delay = self.backoff.next_delay()
                log.warning(
                    "watch stream lost; resuming",
                    prefix=self.prefix,
                    revision=self.revision,
                    error=str(exc) or type(exc).__name__,
                    retry_in_s=round(delay, 3),
                )
                await asyncio.sleep(delay)
            finally:
                if watch is not None:
                    try:
                        async with asyncio.timeout(1.0):
                            await watch.cancel()
                    except Exception:
                        pass


async def _create_watch(store: Store, prefix: str, start_revision: int) -> aetcd.rtypes.Watch:
    """Create an etcd watch; a cancellation waits for the creation to finish, then cancels it.

    aetcd matches a "created" answer to whichever creation is pending on the stream: a creation
    cancelled half-way leaves its answer to the NEXT watch created, which then silently watches
    the cancelled one's keys (and its own answer is cancelled as unexpected). Letting the
    creation complete keeps the pairing right.
    """
    creating = asyncio.ensure_future(
        store.client.watch_prefix(prefix.encode(), start_revision=start_revision)
    )
    try:
        return await asyncio.shield(creating)
    except asyncio.CancelledError:
        try:
            watch = await creating
            await watch.cancel()
        except Exception:
            pass
        raise


def watch_prefix(
    store: Store, prefix: str, cls: type[M], known: Callable[[str, int, bytes], bool] | None = None
) -> PrefixWatch[M]:
    return PrefixWatch(store, prefix, cls, known=known)


class PrefixWatcher(Protocol):
    """``watch_prefix`` or a stand-in with the same stream semantics (a host of many simulated
    agents shares one watch per prefix)."""

    def __call__(
        self, store: Store, prefix: str, cls: type[M]
    ) -> AsyncIterable[WatchEvent[M] | Resync[M]]: ...
