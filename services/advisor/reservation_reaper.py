"""Releasing the extender's reservations once they have served, or once their domain is gone.

The first pod of a domain reserves nodes for all its pods (`domain_placement.py`) with a TTL of
minutes. The reservation is only needed until the pods are bound: once every node it holds is
bound to its domain (`nodebindings/<node>`, written when the node joins), the bindings hold the
nodes and the reservation goes (reason `served`). Nodes of a reservation the domain never used
keep it until the TTL, or until the domain is gone: when its record is deleted or marked
deleting, all its extender reservations go at once (`domain-deleted`). A reservation of a domain
the store has no record of (deleted while no advisor watched, say) goes once it has been seen so
for `absent_grace_s` (`domain-absent`): a record is mirrored before its claim template exists, so
a live domain's record is there long before the grace ends. Reservations of other holders (gRPC
clients) are never touched.

Every advisor replica runs a reaper. A removal is guarded by the record's revision as the
fleet index saw it: of two replicas one removes it and the other's compare fails (harmless), and a
reservation written anew under the same id is never removed on a stale view.

Events (a binding, a reservation, a domain going) mark their domain; the loop releases what is
due for the marked domains, and every `sweep_period_s` looks at every domain again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from libs.gen.computedomain.state import v1 as pb
from libs.runtime.backoff import Backoff
from libs.runtime.errors import RetryableError
from libs.state.store import TRANSIENT_ERRORS
from services.advisor.domain_placement import DomainPlacer
from services.advisor.domain_presence import DomainPresence
from services.advisor.fleet_feeds import wait_changed
from services.advisor.metrics import AdvisorMetrics
from services.advisor.reservations import fits_one_txn, remove_if_unchanged

log = structlog.get_logger(__name__)

SERVED = "served"
DOMAIN_DELETED = "domain-deleted"
DOMAIN_ABSENT = "domain-absent"
ABSENT_GRACE_S = 30.0
SWEEP_PERIOD_S = 5.0
# Releases in flight at once (they share transactions through the advisor's commit batcher).
MAX_CONCURRENT = 64

_RETRYABLE = (*TRANSIENT_ERRORS, RetryableError)


class ReservationReaper:
    """Releases due extender reservations; `attach` it to its sources, then `run` it."""

    def __init__(
        self,
        placer: DomainPlacer,
        presence: DomainPresence,
        metrics: AdvisorMetrics | None = None,
        absent_grace_s: float = ABSENT_GRACE_S,
        sweep_period_s: float = SWEEP_PERIOD_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.placer = placer
        self.presence = presence
        self.fleet = placer.advisor.fleet
        self.metrics = metrics or placer.advisor.metrics
        self.absent_grace_s = absent_grace_s
        self.sweep_period_s = sweep_period_s
        self.clock = clock
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()
        # Reservation id -> when it was first seen with no record of its domain in the store.
        self._absent_since: dict[str, float] = {}

    def attach(self) -> None:
        """Be told of every domain whose bindings or reservations change, and of every domain gone."""
        self.fleet.on_domain_change = self.note
        self.presence.on_gone = self.note

    def note(self, domain_uid: str) -> None:
        self._dirty.add(domain_uid)
        self._wake.set()

    # ---- what is due ----------------------------------------------------------------------------

    def due(self, domain_uid: str) -> list[tuple[pb.Reservation, str]]:
        """The domain's extender reservations to release now, each with the reason."""
        ours = [r for r in self.fleet.domain_reservations(domain_uid) if self.placer.made_by_extender(r)]
        if not ours:
            return []
        if self.presence.synced.is_set():
            state = self.presence.state(domain_uid)
            if state == "gone":
                return [(r, DOMAIN_DELETED) for r in ours]
            if state == "unknown":
                now = self.clock()
                absent = [
                    r for r in ours if now - self._absent_since.setdefault(r.id, now) >= self.absent_grace_s
                ]
                if absent:
                    return [(r, DOMAIN_ABSENT) for r in absent]
            else:
                for r in ours:
                    self._absent_since.pop(r.id, None)
        bound = self.fleet.bound
        return [(r, SERVED) for r in ours if all(bound.get(n) == domain_uid for n in r.node_names)]

    # ---- releasing ------------------------------------------------------------------------------

    async def release(self, record: pb.Reservation, reason: str) -> bool:
        """Remove the reservation as the inventory knows it; False if another writer removed or
        replaced it first (nothing is removed then)."""
        inv = self.fleet
        rid = record.id
        revision = inv.reservation_revision(rid)
        known = inv.reservations.get(rid)
        if not revision or known is None or known is not record:
            return False  # it changed since it was judged: the next round judges it again
        store = self.placer.advisor.store
        if store is None:
            raise RuntimeError("the advisor has no store: reservations cannot be released")
        removed_at = await remove_if_unchanged(
            store, rid, record.node_names, revision, self.placer.advisor.batcher
        )
        self._absent_since.pop(rid, None)
        if removed_at is None:
            log.debug(
                "reservation already released by another writer", cd_uid=record.domain_uid, reservation=rid
            )
            return False
        if removed_at and fits_one_txn(record.node_names):
            inv.apply_reservation(rid, None, removed_at)
        self.metrics.extender_releases.labels(reason).inc()
        log.info(
            "extender reservation released",
            cd_uid=record.domain_uid,
            reservation=rid,
            reason=reason,
            nodes=len(record.node_names),
            holder=record.holder,
        )
        return True

    async def reap(self, domains: set[str]) -> set[str]:
        """Release what is due for `domains`; the domains whose release failed on the store."""
        work = [(uid, record, reason) for uid in sorted(domains) for record, reason in self.due(uid)]
        failed: set[str] = set()
        for start in range(0, len(work), MAX_CONCURRENT):
            chunk = work[start : start + MAX_CONCURRENT]
            results = await asyncio.gather(
                *(self.release(r, why) for _, r, why in chunk), return_exceptions=True
            )
            for (uid, record, _), result in zip(chunk, results, strict=True):
                if isinstance(result, _RETRYABLE):
                    failed.add(uid)
                    log.warning(
                        "reservation release failed; retrying",
                        cd_uid=uid,
                        reservation=record.id,
                        error=str(result) or type(result).__name__,
                    )
                elif isinstance(result, BaseException):
                    raise result
        return failed

    def _prune_absent(self) -> None:
        known = self.fleet.reservations
        for rid in [r for r in self._absent_since if r not in known]:
            del self._absent_since[rid]

    async def run(self) -> None:
        """Release due reservations until cancelled (waits for the inventory to be synced)."""
        inv = self.fleet
        while not inv.ready:
            await wait_changed(inv, inv.generation, 1.0)
        loop = asyncio.get_running_loop()
        backoff = Backoff(initial=0.1, cap=5.0)
        next_sweep = loop.time()
        while True:
            if not self._dirty:
                try:
                    async with asyncio.timeout(max(0.0, next_sweep - loop.time())):
                        await self._wake.wait()
                except TimeoutError:
                    pass
            self._wake.clear()
            if loop.time() >= next_sweep:
                self._prune_absent()
                # "" gathers the reservations of no domain (gRPC clients'): none is the extender's.
                self._dirty.update(uid for uid in inv.reservations_by_domain if uid)
                next_sweep = loop.time() + self.sweep_period_s
            domains, self._dirty = self._dirty, set()
            failed = await self.reap(domains)
            if failed:
                self._dirty |= failed
                await asyncio.sleep(backoff.next_delay())
            else:
                backoff.reset()
