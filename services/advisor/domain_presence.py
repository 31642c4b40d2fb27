"""Which ComputeDomains exist, as far as the store says: the advisor's view of domain lifecycles.

The extender's reservations for a domain must go when the domain goes. The advisor needs only
"exists" and "deleting" of each domain, so it watches `domains/` reading each record as a
`DomainGate` (uid, deleting, mesh mode): the status and node list of a large domain, which the
controller rewrites while the domain forms, are skipped undecoded.

A domain is *gone* once the watch showed its record deleted or marked deleting, or a new
listing (after a compaction) no longer holds a domain seen before. A domain never seen is
*unknown*: its record may not be mirrored yet, or it was deleted while no advisor watched; the
reaper decides what an unknown domain's reservations are worth (`reservation_reaper.py`).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import Literal

import structlog

from libs.runtime.backoff import Backoff
from libs.state.domain_record import DomainRecord as DomainGate
from libs.state.keys import Keys
from libs.state.store import TRANSIENT_ERRORS, Store
from libs.state.watch import Resync, watch_prefix

log = structlog.get_logger(__name__)

# Gone uids are remembered so that a late pod of a deleted domain is refused; uids are never
# reused, and this many cover every domain deleted in hours of busy operation.
MAX_GONE = 65_536

State = Literal["present", "gone", "unknown"]


class DomainPresence:
    """The set of live domains and the recently gone ones; `follow` keeps it current."""

    def __init__(self, on_gone: Callable[[str], None] | None = None, max_gone: int = MAX_GONE) -> None:
        self.present: set[str] = set()
        # spec.numNodes of the present domains whose record was read (0: not set).
        self._num_nodes: dict[str, int] = {}
        self._gone: OrderedDict[str, None] = OrderedDict()
        self.max_gone = max_gone
        self.on_gone = on_gone
        self.synced = asyncio.Event()

    def state(self, uid: str) -> State:
        if uid in self.present:
            return "present"
        if uid in self._gone:
            return "gone"
        return "unknown"

    def is_gone(self, uid: str) -> bool:
        return uid in self._gone

    def num_nodes(self, uid: str) -> int | None:
        """A present domain's spec.numNodes, 0 when it sets none; None when no record of it was
        read (unknown, gone, or only its key seen)."""
        return self._num_nodes.get(uid)

    # ---- updates (the feed calls these; tests may too) ------------------------------------

    def mark_gone(self, uid: str, why: str) -> None:
        self.present.discard(uid)
        self._num_nodes.pop(uid, None)
        if uid in self._gone:
            return
        self._gone[uid] = None
        while len(self._gone) > self.max_gone:
            self._gone.popitem(last=False)
        log.info("domain gone", cd_uid=uid, reason=why)
        if self.on_gone is not None:
            self.on_gone(uid)

    def apply(self, uid: str, record: DomainGate | None) -> None:
        """A domain record was written (`record`) or deleted (None)."""
        if record is None:
            self.mark_gone(uid, "record deleted")
        elif record.deleting:
            self.mark_gone(uid, "marked deleting")
        elif uid not in self._gone:
            self.present.add(uid)
            self._num_nodes[uid] = max(0, int(record.spec.num_nodes))

    def resync(self, records: dict[str, DomainGate], unreadable: Collection[str] = ()) -> None:
        """A full listing: domains seen before and missing from it were deleted meanwhile.
        `unreadable`: uids whose record exists but could not be decoded (a newer schema, say):
        present, not gone."""
        for uid in [u for u in self.present if u not in records and u not in unreadable]:
            self.mark_gone(uid, "record deleted")
        for uid, record in records.items():
            self.apply(uid, record)
        for uid in unreadable:
            self.apply_unreadable(uid)
        self.synced.set()

    def apply_unreadable(self, uid: str) -> None:
        """A record this build cannot decode: it exists, and says nothing about deletion."""
        if uid not in self._gone:
            self.present.add(uid)

    # ---- the store feed ----------------------------------------------------------------------

    async def follow(self, store: Store) -> None:
        """Keep the view current from the store until cancelled."""
        prefix = store.keys.domains()
        async for item in watch_prefix(store, prefix, DomainGate):
            if isinstance(item, Resync):
                records = {Keys.last_segment(v.key): v.value for v in item.items}
                # A listing skips undecodable values; their keys still exist (keys only: cheap).
                existing = await _keys_under(store, prefix)
                self.resync(records, existing - records.keys())
                log.info("domain presence synced", domains=len(self.present))
            elif item.kind == "undecodable":
                self.apply_unreadable(Keys.last_segment(item.key))
            else:
                self.apply(Keys.last_segment(item.key), item.value)


async def _keys_under(store: Store, prefix: str) -> set[str]:
    """The last segments of the keys under `prefix` (retried with backoff until it answers)."""
    backoff = Backoff(initial=0.05, cap=2.0)
    while True:
        try:
            result = await store.client.get_prefix(prefix.encode(), keys_only=True)
            return {Keys.last_segment(kv.key.decode()) for kv in result}
        except TRANSIENT_ERRORS as exc:
            delay = backoff.next_delay()
            log.warning("listing domain keys failed; retrying", error=str(exc), retry_in_s=round(delay, 3))
            await asyncio.sleep(delay)
