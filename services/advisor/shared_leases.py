"""One etcd lease per TTL, shared by every reservation batch written within a short window.

A lease grant is a raft write of its own (fsynced, like the transaction that uses it): granting
one per batch doubled each batch's time in etcd. Here a lease asked for at time t with a TTL of
`ttl + window` serves every batch that starts before t + window, so each record's stated expiry
(its created time + TTL) comes no later than its lease's, and its keys outlive the stated expiry
by at most `window` (1 s: etcd's TTLs are whole seconds). The next lease is asked for halfway
through the window, so under steady load no batch waits for a grant.

A lease is shared, so it is never revoked to undo one batch: the batcher deletes what a failed
batch may have written instead, and `forget` drops a lease etcd refused (it then grants anew).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from libs.state.store import Store

log = structlog.get_logger(__name__)

WINDOW_S = 1.0


@dataclass(frozen=True, slots=True)
class SharedLease:
    id: int
    # Wall clock (ms) when its grant was asked for: a record written on it states a created time
    # no later than this + the window, so created + TTL never passes the lease's expiry.
    asked_unix_ms: int
    # The same moment on the monotonic clock, for the window.
    asked_at: float


@dataclass(slots=True)
class _Slot:
    current: SharedLease | None = None
    next: asyncio.Task[SharedLease] | None = None


class SharedLeases:
    def __init__(
        self,
        store: Store,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
        wall_ms: Callable[[], int] = lambda: int(time.time() * 1000),
    ) -> None:
        if window_s <= 0:
            raise ValueError("the lease window must be positive")
        self.store = store
        self.window_s = window_s
        self._clock = clock
        self._wall_ms = wall_ms
        self._slots: dict[int, _Slot] = {}
        # For tests: leases granted so far.
        self.granted = 0

    async def lease_for(self, ttl_s: int) -> SharedLease:
        """A lease that outlives a record of `ttl_s` created now (waits for a grant only when none
        is current)."""
        slot = self._slots.setdefault(ttl_s, _Slot())
        age = self._age(slot.current)
        if slot.current is not None and age < self.window_s:
            if age >= self.window_s / 2 and not self._coming(slot.next):
                slot.next = self._ask(ttl_s)
            return slot.current
        asked = slot.next
        if asked is None or not self._coming(asked):
            asked = slot.next = self._ask(ttl_s)
        # Shielded: a cancelled batch leaves the grant to the batches after it.
        lease = await asyncio.shield(asked)
        if slot.next is asked:
            slot.next = None
        if slot.current is None or lease.asked_at > slot.current.asked_at:
            slot.current = lease
        # Even a grant slower than the window serves this batch: `created_unix_ms` caps the
        # record's created time at the window's end, which keeps it within the lease.
        return lease

    def created_unix_ms(self, lease: SharedLease) -> int:
        """The created time to state for a record written on `lease` now (never past its window)."""
        return min(self._wall_ms(), lease.asked_unix_ms + int(self.window_s * 1000))

    def forget(self, lease_id: int) -> None:
        """Stop handing out a lease (etcd refused it, or a batch on it failed)."""
        for slot in self._slots.values():
            if slot.current is not None and slot.current.id == lease_id:
                slot.current = None

    async def close(self) -> None:
        """Stop asking for leases; the ones granted expire by themselves."""
        pending = [slot.next for slot in self._slots.values() if slot.next is not None]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self._slots.clear()

    def _coming(self, asked: asyncio.Task[SharedLease] | None) -> bool:
        """Whether a grant asked for ahead will serve: still on its way (awaited however long it
        takes), or granted within the window. One that failed, or was left unused through a quiet
        spell (its lease near its end, or gone), will not."""
        if asked is None or asked.cancelled():
            return False
        if not asked.done():
            return True
        return asked.exception() is None and self._age(asked.result()) < self.window_s

    def _age(self, lease: SharedLease | None) -> float:
        return math.inf if lease is None else self._clock() - lease.asked_at

    def _ask(self, ttl_s: int) -> asyncio.Task[SharedLease]:
        task = asyncio.ensure_future(self._grant(ttl_s))
        task.add_done_callback(self._log_failure)
        return task

    async def _grant(self, ttl_s: int) -> SharedLease:
        asked_at, asked_ms = self._clock(), self._wall_ms()
        lease_id = await self.store.grant_lease(ttl_s + math.ceil(self.window_s))
        self.granted += 1
        return SharedLease(lease_id, asked_ms, asked_at)

    def _log_failure(self, task: asyncio.Task[SharedLease]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        # The batch waiting for it fails with the same error; a prefetch's failure only shows here.
        log.warning(
            "reservation lease grant failed", error=str(task.exception()) or type(task.exception()).__name__
        )
