"""A deduplicating, rate-limited work queue of domain uids (as controller-runtime's).

- An item queued several times before a worker takes it is processed once.
- An item is never processed by two workers at once: added while in
  process, it is marked dirty and queued again when the worker is done.
- `add_rate_limited` requeues after a per-item exponential delay (failures);
  `forget` resets it after a success.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Hashable
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)


class QueueShutDown(Exception):
    """The queue was shut down; workers should return."""


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
    def __init__(self, backoff: ItemBackoff[T] | None = None) -> None:
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

    def done(self, item: T) -> None:
        self._processing.discard(item)
        if item in self._dirty:
            self._queue.append(item)
            self._wake()

    def clear(self) -> None:
        """Drop everything queued or delayed (leadership lost: the next leader starts afresh)."""
        for handle in self._delayed.values():
            handle.cancel()
        self._delayed.clear()
        self._queue.clear()
        self._dirty.clear()
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
