"""Leader election through the store: one active holder per name.

The leader key lives on the holder's lease; when the holder dies the key
expires with the lease and a standby, watching the key, campaigns at once.
Writes made as leader carry `Leadership.fence` (a compare on the key's
create revision), so a deposed leader's late writes fail instead of landing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aetcd.rtypes
import structlog

from libs.gen.computedomain.state import v1 as pb
from libs.runtime.backoff import Backoff
from libs.state.lease_validity import LeaseValidity
from libs.state.store import Absent, CreatedAt, Put, Store

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Leadership:
    name: str
    holder: str
    key: str
    create_revision: int
    lease_id: int
    acquired_monotonic: float
    # Shared with the election's refresh loop: until when this term may act (loop-clock seconds).
    validity: LeaseValidity | None = None

    @property
    def fence(self) -> CreatedAt:
        return CreatedAt(self.key, self.create_revision)

    def may_act(self) -> bool:
        """Whether the lease is certainly still valid: checked right before a write that etcd's
        fence cannot guard (Kubernetes objects)."""
        return self.validity is None or self.validity.may_act(time.monotonic())


LeadFunction = Callable[[Leadership], Coroutine[Any, Any, None]]


class LeaderElection:
    def __init__(self, store: Store, name: str, holder: str, ttl_s: int = 5) -> None:
        if ttl_s < 1:
            raise ValueError(f"invalid leader lease TTL {ttl_s!r}: must be >= 1 s")
        self.store = store
        self.name = name
        self.holder = holder
        self.ttl_s = ttl_s
        self.key = store.keys.election(name)
        self.is_leader = False
        self.terms = 0

    async def current_leader(self) -> str | None:
        record = await self.store.get(self.key, pb.LeaderRecord)
        return record.value.holder if record else None

    async def _try_acquire(self) -> Leadership | None:
        sent_at = time.monotonic()
        lease_id = await self.store.grant_lease(self.ttl_s)
        record = pb.LeaderRecord(holder=self.holder, acquired_unix_ms=int(time.time() * 1000))
        result = await self.store.txn([Absent(self.key)], [Put(self.key, record, lease_id)])
        if not result.succeeded:
            await self.store.revoke_lease(lease_id)
            return None
        validity = LeaseValidity(self.ttl_s, margin_s=min(0.2, self.ttl_s / 10))
        validity.granted(sent_at)
        return Leadership(
            self.name, self.holder, self.key, result.revision, lease_id, time.monotonic(), validity
        )

    async def _wait_for_vacancy(self) -> None:
        """Return once the leader key is gone (or seems to be); bounded by the TTL per check."""
        current = await self.store.client.get(self.key.encode())
        if current is None:
            return
        watch = await self.store.client.watch(self.key.encode(), start_revision=int(current.mod_revision) + 1)
        try:

            async def first_delete() -> None:
                async for event in watch:
                    if event.kind == aetcd.rtypes.EventKind.DELETE:
                        return

            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.ttl_s):
                    await first_delete()
        finally:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await watch.cancel()

    async def _hold(self, leadership: Leadership) -> None:
        """Refresh the lease until it is lost, or until it could have expired; return then."""
        validity = leadership.validity
        assert validity is not None
        while True:
            pause = min(self.ttl_s / 3, validity.valid_until - validity.margin_s - time.monotonic())
            if pause > 0:
                await asyncio.sleep(pause)
            sent_at = time.monotonic()
            timeout = validity.refresh_timeout(sent_at)
            if timeout <= 0:
                log.warning("leader lease could have expired; stepping down", election=self.name)
                return
            try:
                async with asyncio.timeout(timeout):
                    remaining = await self.store.refresh_lease(leadership.lease_id)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning(
                    "leader lease refresh failed", election=self.name, error=str(exc) or type(exc).__name__
                )
                continue  # the next pass steps down once the validity is used up
            if remaining <= 0:
                return
            validity.granted(sent_at, remaining)

    async def run(self, lead: LeadFunction) -> None:
        """Campaign forever; while leader, run `lead` (cancelled when leadership is lost)."""
        backoff = Backoff(initial=0.1, cap=2.0)
        while True:
            try:
                leadership = await self._try_acquire()
                if leadership is None:
                    await self._wait_for_vacancy()
                    continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                delay = backoff.next_delay()
                log.warning(
                    "campaign failed; retrying",
                    election=self.name,
                    error=str(exc) or type(exc).__name__,
                    retry_in_s=round(delay, 3),
                )
                await asyncio.sleep(delay)
                continue
            backoff.reset()
            self.is_leader = True
            self.terms += 1
            log.info("became leader", election=self.name, holder=self.holder, term=self.terms)
            lead_task = asyncio.create_task(lead(leadership), name=f"lead:{self.name}")
            hold_task = asyncio.create_task(self._hold(leadership), name=f"hold:{self.name}")
            try:
                done, _ = await asyncio.wait({lead_task, hold_task}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                self.is_leader = False
                for task in (lead_task, hold_task):
                    task.cancel()
                for task in (lead_task, hold_task):
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
            if lead_task in done and not lead_task.cancelled() and lead_task.exception() is not None:
                log.error(
                    "leader work failed; resigning", election=self.name, error=repr(lead_task.exception())
                )
            else:
                log.warning("leadership lost", election=self.name, holder=self.holder)
            with contextlib.suppress(Exception):
                await self.store.revoke_lease(leadership.lease_id)
