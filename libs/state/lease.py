"""A lease kept alive in the background, re-granted after it is lost.

Keys written on the lease vanish when the holder stops refreshing it (crash,
partition): that is how node loss and leader loss become visible to others.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from libs.runtime.backoff import Backoff
from libs.state.store import Store

log = structlog.get_logger(__name__)

LeaseCallback = Callable[[int], Awaitable[None]]


class KeptLease:
    """Grant a lease, refresh it every ttl/3, report its loss, and grant a new one.

    `on_acquired(lease_id)` runs after each grant (write your keys on the lease
    there); `on_lost(lease_id)` runs when the lease expired or could not be
    refreshed for a whole TTL.
    """

    def __init__(
        self,
        store: Store,
        ttl_s: int,
        on_acquired: LeaseCallback | None = None,
        on_lost: LeaseCallback | None = None,
        regrant: bool = True,
    ) -> None:
        if ttl_s < 1:
            raise ValueError(f"invalid lease TTL {ttl_s!r}: must be >= 1 s")
        self.store = store
        self.ttl_s = ttl_s
        self.on_acquired = on_acquired
        self.on_lost = on_lost
        self.regrant = regrant
        self.lease_id: int | None = None
        self.acquired = asyncio.Event()
        self.losses = 0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        grant_backoff = Backoff(initial=0.1, cap=2.0)
        while True:
            try:
                lease_id = await self.store.grant_lease(self.ttl_s)
            except Exception as exc:
                delay = grant_backoff.next_delay()
                log.warning(
                    "lease grant failed; retrying",
                    error=str(exc) or type(exc).__name__,
                    retry_in_s=round(delay, 3),
                )
                await asyncio.sleep(delay)
                continue
            grant_backoff.reset()
            self.lease_id = lease_id
            last_ok = loop.time()
            try:
                if self.on_acquired is not None:
                    await self.on_acquired(lease_id)
                self.acquired.set()
                while True:
                    await asyncio.sleep(self.ttl_s / 3)
                    try:
                        # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation.
                        async with asyncio.timeout(self.ttl_s / 2):
                            remaining = await self.store.refresh_lease(lease_id)
                    except asyncio.CancelledError:
                        raise
                    except Exception as exc:
                        log.warning(
                            "lease refresh failed", lease=lease_id, error=str(exc) or type(exc).__name__
                        )
                        if loop.time() - last_ok < self.ttl_s:
                            continue
                        remaining = 0
                    if remaining <= 0:
                        break
                    last_ok = loop.time()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.error(
                    "lease holder callback failed", lease=lease_id, error=str(exc) or type(exc).__name__
                )
            self.acquired.clear()
            self.lease_id = None
            self.losses += 1
            log.warning("lease lost", lease=lease_id, ttl_s=self.ttl_s)
            if self.on_lost is not None:
                await self.on_lost(lease_id)
            if not self.regrant:
                return

    async def revoke(self) -> None:
        if self.lease_id is not None:
            await self.store.revoke_lease(self.lease_id)
            self.lease_id = None
