"""aetcd's watch stream, made safe for many watches and slow answers.

One gRPC stream carries all of a client's watches; aetcd creates them one at a time and takes
any "created" answer for the creation pending at that moment. Two things break that:

* **A creation that timed out.** aetcd gives up after the client timeout and starts the next
  creation; the late answer to the abandoned one then arrives while the next one is pending and
  is taken for it. The next watch silently carries the abandoned one's keys, and its own answer
  is cancelled as unexpected. Under load (hundreds of watches, a busy loop) one timeout cascades
  into hundreds of such cross-wired watches. Here every creation asks etcd for a watch id of its
  own (etcd assigns a client-chosen `watch_id` since 3.4), and an answer counts only for the
  creation that asked for that id; a late answer's watch is cancelled.
* **Watches etcd refuses or cancels.** etcd refuses a create (bad token, no permission, future
  revision) with a response that is both `created` and `canceled`, and may cancel a live watch;
  aetcd ignores `canceled` and registers a watch that never delivers. Here the pending creation
  fails instead, and a cancelled live watch gets an error. Compaction keeps aetcd's own handling
  (RevisionCompactedError).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import Any

import aetcd.exceptions
from aetcd import watcher

# etcd's answers to a request whose token it does not accept (any more): the token is
# unknown (etcd restarted, or the token expired), it predates a change of the auth
# store, or it is missing. Authenticating again cures each of them.
STALE_TOKEN_MARKERS = (
    "invalid auth token",
    "revision of auth store is old",
    "user name is empty",
)


def watch_refused(reason: str) -> aetcd.exceptions.ClientError:
    """The error of a watch etcd refused or cancelled, for `reason` (its cancel_reason)."""
    if any(m in reason for m in STALE_TOKEN_MARKERS):
        return aetcd.exceptions.UnauthenticatedError(reason)
    return aetcd.exceptions.ClientError(f"etcd cancelled the watch: {reason or 'no reason given'}")


class PairedWatcher(watcher.Watcher):
    """aetcd's Watcher whose creations are paired with their answers by watch id."""

    def __init__(self, *args: Any, ids: Iterator[int] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._request_queue: asyncio.Queue[Any] = asyncio.Queue()  # unbounded: see _terminate_stream
        # Unique on every stream this watcher opens. A client that replaces its watcher (failover
        # to another etcd member) shares one sequence between them: aetcd cancels a watch through
        # the client's current watcher by id, and a reused id would cancel another live watch.
        self._ids = ids if ids is not None else itertools.count(1)
        self._pending_id: int | None = None
        self.stale_answers = 0  # late "created" answers cancelled (creations that had timed out)
        # Set when the client moved to another etcd member: no new watch on this one's stream
        # (closing its channel later would end such a stream without telling its watches).
        self.retired = False

    async def add_callback(
        self,
        key: bytes,
        callback: Any,
        range_end: bytes | None = None,
        start_revision: int | None = None,
        progress_notify: bool = False,
        kind: Any = None,
        prev_kv: bool = False,
        watch_id: int | None = None,
        fragment: bool = False,
    ) -> watcher.WatcherCallback:
        # aetcd's add_callback, with the watch id chosen here and remembered as pending.
        async with self._lock:
            while self._new_callback is not None:  # type: ignore[has-type]
                await self._new_callback_ready.wait()
            if self.retired:
                raise aetcd.exceptions.ConnectionFailedError("etcd client moved to another member")
            # After the wait: a stream ended meanwhile is opened again for this creation.
            await self.setup()
            created = watcher.WatcherCallback(callback)
            created.prev_kv = prev_kv
            self._new_callback = created
            self._pending_id = watch_id or next(self._ids)
            await self._enqueue_watch_create(
                key,
                range_end=range_end,
                start_revision=start_revision,
                progress_notify=progress_notify,
                kind=kind,
                prev_kv=prev_kv,
                watch_id=self._pending_id,
                fragment=fragment,
            )
            try:
                try:
                    await asyncio.wait_for(self._new_callback_ready.wait(), self._timeout)
                except TimeoutError:
                    raise aetcd.exceptions.WatchTimeoutError from None
                if created.watch_id is None and created.error is None:
                    raise aetcd.exceptions.WatchTimeoutError
                if created.error is not None:
                    raise created.error
            finally:
                self._new_callback = None
                self._pending_id = None
                self._new_callback_ready.notify_all()
            return created

    async def _terminate_stream(self, error: Any) -> None:
        # aetcd's, with unbounded request queues: aetcd puts into a queue of 10 while holding the
        # lock, and when no stream reads that queue (the member is gone) the put never returns,
        # so every watch creation of the client waits on the lock for good.
        async with self._lock:
            if self._new_callback is not None:
                self._new_callback.error = error
                self._new_callback_ready.notify_all()
            callbacks: dict[int, Any] = self._callbacks
            self._callbacks: dict[int, Any] = {}
            self._request_queue.put_nowait(None)  # ends the old stream's request iterator
            self._request_queue = asyncio.Queue()
        for callback in callbacks.values():
            await self._process_callback(callback, error)
        async with self._request_handler_lock:
            handler: asyncio.Task[None] | None = self._request_handler  # type: ignore[has-type]
            if handler is not None:
                handler.cancel()
                try:
                    await handler
                except asyncio.CancelledError:
                    pass
                self._request_handler = None

    def _build_watch_create_request(self, *args: Any, **kwargs: Any) -> Any:
        # aetcd accepts watch_id and fragment but leaves them out of the request.
        request = super()._build_watch_create_request(*args, **kwargs)
        request.create_request.watch_id = kwargs.get("watch_id") or 0
        request.create_request.fragment = bool(kwargs.get("fragment"))
        return request

    async def _handle_response(self, response: Any) -> None:
        if response.created and response.watch_id != self._pending_id and response.watch_id >= 0:
            # The answer to a creation that gave up waiting: not the pending one's.
            async with self._lock:
                self.stale_answers += 1
                if not response.canceled:
                    await self._enqueue_watch_cancel(watch_id=response.watch_id)
            return
        if not response.canceled or response.compact_revision != 0:
            await super()._handle_response(response)
            return
        error = watch_refused(response.cancel_reason)
        async with self._lock:
            if response.created:
                if self._new_callback is not None:
                    self._new_callback.error = error
                    self._new_callback_ready.notify_all()
                return
            # A cancel we asked for has already been removed from the callbacks.
            callback = self._callbacks.pop(response.watch_id, None)
        if callback is not None:
            await self._process_callback(callback, error)
