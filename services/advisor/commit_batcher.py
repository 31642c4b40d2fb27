"""Group commit: the reservation writes of concurrent decisions share one etcd transaction.

Each write is a unit: its own compares and writes, and optionally a TTL its puts live for.
Units that arrive while `max_inflight` batches are in flight wait, and leave together in the
next batch: one request of nested transactions (`Store.txn_each`), each decided on its own
compares, so a unit that loses its race fails alone. At low load a unit leaves at once in a
batch of one; under load the batches grow, and the per-decision cost of the round trips with
them shrinks.

Units that want the same TTL are written on one lease, shared with the batches of the same
second (`SharedLeases`); `Committed.created_unix_ms` is stated so that a record's created + TTL
never outlives its lease. A batch whose request fails (etcd unreachable, a timeout) fails every
unit in it and no other. Its request may still have been applied, and its lease is shared, so
each unit's `undo` transaction (a guarded delete of what it wrote) is run afterwards, with
retries; a TTL is the backstop when etcd stays away.

A batch never carries two units that touch one key (etcd refuses a request that writes a key
twice, and a unit's compares must see what an earlier unit wrote): the later unit waits for the
next batch. etcd's --max-txn-ops (128 by default) bounds the batch: a nested transaction may
have only as many compares or writes as the limit leaves after the units of the outer one, so
units + the largest unit's compares (or writes) stay within `max_ops`. A batch also carries at
most about `max_bytes` of keys and values (etcd's --max-request-bytes is 1.5 MiB by default).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import structlog

from libs.state.store import Compare, Op, Store, with_retries
from services.advisor.shared_leases import SharedLeases

log = structlog.get_logger(__name__)

MAX_OPS = 128
MAX_BYTES = 1 << 20
MAX_INFLIGHT = 2


@dataclass(frozen=True, slots=True)
class Committed:
    """A unit's outcome: whether its compares held (its writes applied), at which revision."""

    succeeded: bool
    revision: int
    # The lease its puts were written with (0: none).
    lease: int
    # Wall clock (ms) to state as the record's created time: created + TTL is within the lease.
    created_unix_ms: int


# (lease, created_unix_ms) -> the unit's writes.
Build = Callable[[int, int], Sequence[Op]]
# The transaction removing what a unit wrote, if its request was applied: (compares, writes).
# Built only when a batch failed.
Undo = Callable[[], tuple[Sequence[Compare], Sequence[Op]]]

# How long the undo of a failed batch is retried (the etcd outage that failed it may be brief).
UNDO_DEADLINE_S = 5.0


@dataclass(slots=True)
class _Unit:
    compares: Sequence[Compare]
    build: Build
    ttl_s: int
    writes: frozenset[str]
    reads: frozenset[str]
    size: int
    # Compares or writes, whichever are more: what etcd's --max-txn-ops counts.
    weight: int
    future: asyncio.Future[Committed]
    undo: Undo | None


class CommitBatcher:
    def __init__(
        self,
        store: Store,
        max_ops: int = MAX_OPS,
        max_bytes: int = MAX_BYTES,
        max_inflight: int = MAX_INFLIGHT,
    ) -> None:
        if max_ops < 2 or max_inflight < 1:
            raise ValueError("max_ops must be >= 2 and max_inflight >= 1")
        self.store = store
        self.max_ops = max_ops
        self.max_bytes = max_bytes
        self.max_inflight = max_inflight
        self.leases = SharedLeases(store)
        self._queue: deque[_Unit] = deque()
        self._inflight: set[asyncio.Task[None]] = set()
        self._cleanups: set[asyncio.Task[None]] = set()
        self._closed = False
        # Counters for metrics and tests.
        self.batches = 0
        self.units = 0

    # ---- submitting ------------------------------------------------------------------------

    def submit(
        self,
        compares: Sequence[Compare],
        build: Build,
        writes: Collection[str],
        ttl_s: int = 0,
        size: int = 0,
        undo: Undo | None = None,
    ) -> asyncio.Future[Committed]:
        """Queue a unit; its future resolves when its batch is committed (or fails with the batch).

        `writes` names every key `build` writes; `size` estimates its bytes; `undo` removes what
        the unit wrote, and is run when its batch failed in a way that may have applied it. A
        caller that stops waiting calls `withdraw`, and when the unit had left already,
        `undo_if_written`."""
        if self._closed:
            raise RuntimeError("the commit batcher is closed")
        keys = frozenset(writes)
        weight = max(len(compares), len(keys))
        if 1 + weight > self.max_ops:
            raise ValueError(f"a unit of {weight} compares or writes does not fit a batch of {self.max_ops}")
        future: asyncio.Future[Committed] = asyncio.get_running_loop().create_future()
        unit = _Unit(
            compares, build, ttl_s, keys, frozenset(c.key for c in compares), size, weight, future, undo
        )
        self._queue.append(unit)
        self._kick()
        return future

    def withdraw(self, future: asyncio.Future[Committed]) -> bool:
        """Take a unit out before its batch leaves: True if it was still queued (never written)."""
        for unit in self._queue:
            if unit.future is future:
                self._queue.remove(unit)
                future.cancel()
                return True
        return False

    def undo_if_written(self, future: asyncio.Future[Committed], undo: Callable[[Committed], object]) -> None:
        """For a caller that stops waiting: when the unit turns out written, run `undo(committed)`
        (a coroutine is run as a task the batcher keeps, and awaits in `close`)."""

        def settled(done: asyncio.Future[Committed]) -> None:
            if done.cancelled() or done.exception() is not None:
                return
            committed = done.result()
            if not committed.succeeded:
                return
            outcome = undo(committed)
            if asyncio.iscoroutine(outcome):
                task: asyncio.Task[None] = asyncio.ensure_future(outcome)
                self._cleanups.add(task)
                task.add_done_callback(self._cleanups.discard)

        future.add_done_callback(settled)

    # ---- batching -----------------------------------------------------------------------------

    def _kick(self) -> None:
        while self._queue and len(self._inflight) < self.max_inflight:
            batch = self._take()
            if not batch:
                return
            task = asyncio.ensure_future(self._send(batch))
            self._inflight.add(task)
            task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._inflight.discard(task)
        if not self._closed:
            self._kick()

    def _take(self) -> list[_Unit]:
        """The next batch, in arrival order; units that clash with it stay queued."""
        batch: list[_Unit] = []
        writes: set[str] = set()
        reads: set[str] = set()
        size = 0
        heaviest = 0
        kept: deque[_Unit] = deque()
        while self._queue:
            unit = self._queue.popleft()
            if unit.future.done():
                continue  # withdrawn by its caller
            over = len(batch) + 1 + max(heaviest, unit.weight) > self.max_ops
            full = over or (bool(batch) and size + unit.size > self.max_bytes)
            clash = not writes.isdisjoint(unit.writes) or not writes.isdisjoint(unit.reads)
            clash = clash or not reads.isdisjoint(unit.writes)
            if full or clash:
                kept.append(unit)
                if full:
                    break
                continue
            batch.append(unit)
            writes |= unit.writes
            reads |= unit.reads
            size += unit.size
            heaviest = max(heaviest, unit.weight)
        kept.extend(self._queue)
        self._queue = kept
        return batch

    async def _send(self, batch: list[_Unit]) -> None:
        leases: dict[int, tuple[int, int]] = {}  # TTL -> (lease, created_unix_ms)
        sent = False
        try:
            ttls = sorted({u.ttl_s for u in batch if u.ttl_s > 0})
            # One after another, not gathered: a current lease is handed back without a trip
            # through the event loop, which takes milliseconds on a busy advisor.
            shared = [await self.leases.lease_for(ttl) for ttl in ttls]
            leases = {
                ttl: (lease.id, self.leases.created_unix_ms(lease))
                for ttl, lease in zip(ttls, shared, strict=True)
            }
            now_ms = int(time.time() * 1000)
            txns = [(u.compares, u.build(*leases.get(u.ttl_s, (0, now_ms)))) for u in batch]
            sent = True
            results, revision = await self.store.txn_each(txns)
        except BaseException as exc:
            for unit in batch:
                if not unit.future.done():
                    if isinstance(exc, asyncio.CancelledError):
                        unit.future.cancel()
                    else:
                        unit.future.set_exception(exc)
            for lease, _ in leases.values():
                # etcd may have refused the lease itself (expired, revoked): the next batch asks anew.
                self.leases.forget(lease)
            undos = [u.undo() for u in batch if u.undo is not None] if sent else []
            if undos:
                # The request may have been applied although its answer was lost.
                task = asyncio.ensure_future(self._undo(undos))
                self._cleanups.add(task)
                task.add_done_callback(self._cleanups.discard)
            if isinstance(exc, Exception):
                log.warning(
                    "reservation batch failed", units=len(batch), error=str(exc) or type(exc).__name__
                )
                return
            raise
        self.batches += 1
        self.units += len(batch)
        for unit, succeeded in zip(batch, results, strict=True):
            if not unit.future.done():
                lease, created_ms = leases.get(unit.ttl_s, (0, now_ms))
                unit.future.set_result(Committed(succeeded, revision, lease if succeeded else 0, created_ms))

    async def _undo(self, undos: list[tuple[Sequence[Compare], Sequence[Op]]]) -> None:
        """Run the undo transactions of a failed batch's units, retried while etcd is away."""
        try:
            await with_retries(
                lambda: self.store.txn_each(undos), "undo a failed reservation batch", UNDO_DEADLINE_S
            )
        except Exception as exc:
            log.warning(
                "failed batch not undone; its reservations expire with their TTL",
                units=len(undos),
                error=str(exc) or type(exc).__name__,
            )

    # ---- lifecycle ----------------------------------------------------------------------------

    async def drained(self, timeout_s: float) -> set[asyncio.Task[None]]:
        """Wait (at most `timeout_s`) for the batches in flight and the undos of failed ones to
        end; the tasks still running then."""
        pending = [*self._inflight, *self._cleanups]
        if not pending:
            return set()
        _, late = await asyncio.wait(pending, timeout=timeout_s)
        return late

    async def close(self, timeout_s: float = 5.0) -> None:
        """Refuse new units, let the batches in flight finish (within `timeout_s`), fail the rest."""
        self._closed = True
        late = await self.drained(timeout_s)
        for task in late:
            task.cancel()
        if late:
            await asyncio.wait(late, timeout=timeout_s)
        while self._queue:
            unit = self._queue.popleft()
            if not unit.future.done():
                unit.future.set_exception(RuntimeError("the placement advisor is stopping"))
        await self.leases.close()
