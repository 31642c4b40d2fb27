"""A deduplicating, rate-limited work queue of domain uids (as controller-runtime's).

- An item queued several times before a worker takes it is processed once.
- An item is never processed by two workers at once: added while in
  process, it is marked dirty and queued again when the worker is done.
- `add_rate_limited` requeues after a per-item exponential delay (failures);
  `forget` resets it after a success.
- Optional pacing (`busy_share`): when the worker reports that an item kept it
  busy (computing, not awaiting I/O) for d seconds, the item is not taken again
  for d * (1/busy_share - 1) seconds; adds meanwhile are coalesced into one run
  at the end of that gap. A 256-node domain's member and daemon events arrive by
  the thousand during formation, and each reconcile recomputes its whole status:
  pacing bounds the share of the controller one large domain takes, while a
  small domain (a fraction of a millisecond of computing) is barely delayed.
  Wall time would be the wrong measure: under load a reconcile's awaits include
  everyone else's work, and every domain would be slowed down.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Hashable
from typing import Generic, TypeVar

from libs.runtime.errors import PermanentError

T = TypeVar("T", bound=Hashable)


class QueueShutDown(PermanentError):
    """The queue was shut down; workers should return (it never hands out an item again)."""


class ItemBackoff(Generic[T]):
    """Per-item exponential delay: base * 2**failures, capped."""

    def __init__(self, base_s: float = 0.005, cap_s: float = 30.0) -> None:
        self.base_s = base_s
        self.cap_s = cap_s
        self.failures: dict[T, int] = {}

    def when(self, item: T) -> float:
        n = self.failures.get(item, 0)
        self.failures[item] = n + 1
        return min(self.cap_s, self.base_s * (2**n))

    def forget(self, item: T) -> None:
        self.failures.pop(item, None)

    def retries(self, item: T) -> int:
        return self.failures.get(item, 0)


class WorkQueue(Generic[T]):
    def __init__(
        self, backoff: ItemBackoff[T] | None = None, busy_share: float = 1.0, max_gap_s: float = 1.0
    ) -> None:
        if not 0.0 < busy_share <= 1.0:
            raise ValueError(f"busy_share must be in (0, 1], got {busy_share}")
        self._gap_factor = 1.0 / busy_share - 1.0
        self._max_gap_s = max_gap_s
        self._not_before: dict[T, float] = {}
        self._dones = 0
        self._queue: deque[T] = deque()
        self._dirty: set[T] = set()
        self._processing: set[T] = set()
        self._delayed: dict[T, asyncio.TimerHandle] = {}
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._shutdown = False
        self.backoff: ItemBackoff[T] = backoff or ItemBackoff()
        self.adds = 0

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def processing(self) -> int:
        return len(self._processing)

    def _wake(self) -> None:
        # add() is sync (watch consumers call it per event), so it hands work to one waiting worker.
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def add(self, item: T) -> None:
        if self._shutdown:
            return
        self.adds += 1
        if item in self._dirty:
            return
        not_before = self._not_before.get(item)
        if not_before is not None:
            wait = not_before - asyncio.get_running_loop().time()
            if wait > 0:
                self.add_after(item, wait)
                return
            del self._not_before[item]
        self._dirty.add(item)
        if item in self._processing:
            return
        self._queue.append(item)
        self._wake()

    def add_after(self, item: T, delay_s: float) -> None:
        if self._shutdown:
            return
        if delay_s <= 0:
            self.add(item)
            return
        existing = self._delayed.get(item)
        loop = asyncio.get_running_loop()
        if existing is not None:
            # Keep the earlier of the two deadlines.
            if existing.when() <= loop.time() + delay_s:
                return
            existing.cancel()

        def fire() -> None:
            self._delayed.pop(item, None)
            self.add(item)

        self._delayed[item] = loop.call_later(delay_s, fire)

    def add_rate_limited(self, item: T) -> None:
        self.add_after(item, self.backoff.when(item))

    def forget(self, item: T) -> None:
        self.backoff.forget(item)

    async def get(self) -> T:
        while not self._queue:
            if self._shutdown:
                raise QueueShutDown()
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    # We were handed an item but are leaving: pass the wake-up on.
                    self._wake()
                raise
        item = self._queue.popleft()
        self._processing.add(item)
        self._dirty.discard(item)
        return item

    def done(self, item: T, busy_s: float = 0.0) -> None:
        """The worker is finished with `item`, after `busy_s` seconds of computing on it (pacing)."""
        self._processing.discard(item)
        if busy_s > 0 and self._gap_factor > 0:
            now = asyncio.get_running_loop().time()
            gap = min(self._max_gap_s, busy_s * self._gap_factor)
            if gap > 0:
                self._not_before[item] = now + gap
            self._dones += 1
            if self._dones % 1024 == 0:  # forget the gaps of items that are never added again
                self._not_before = {i: t for i, t in self._not_before.items() if t > now}
        if item in self._dirty:
            if self._not_before.get(item, 0.0) > asyncio.get_running_loop().time():
                self._dirty.discard(item)
                self.add(item)  # schedules it for the end of its gap
                return
            self._queue.append(item)
            self._wake()

    def clear(self) -> None:
        """Drop everything queued or delayed (leadership lost: the next leader starts afresh)."""
        for handle in self._delayed.values():
            handle.cancel()
        self._delayed.clear()
        self._queue.clear()
        self._dirty.clear()
        self._not_before.clear()
        self.backoff.failures.clear()

    def shutdown(self) -> None:
        self._shutdown = True
        for handle in self._delayed.values():
            handle.cancel()
        self._delayed.clear()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
