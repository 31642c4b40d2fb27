"""The reservation batches' shared leases: one grant per TTL and window, asked for ahead, and a
record's stated expiry never past its lease's (a fake clock and a scripted store)."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.state.store import Store
from services.advisor.shared_leases import SharedLeases


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def wall_ms(self) -> int:
        return int(self.now * 1000)


class _Grants:
    """A store whose lease grants are answered when the test says so (or at once)."""

    def __init__(self, clock: _Clock, at_once: bool = True) -> None:
        self.clock = clock
        self.at_once = at_once
        self.asked: list[tuple[int, float]] = []  # (TTL asked for, when)
        self.pending: list[asyncio.Future[int]] = []
        self.fail_next = False

    async def grant_lease(self, ttl_s: int) -> int:
        self.asked.append((ttl_s, self.clock.now))
        if self.fail_next:
            self.fail_next = False
            raise ConnectionError("etcd is away")
        if self.at_once:
            return len(self.asked)
        answer: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.pending.append(answer)
        return await answer

    def answer_all(self) -> None:
        for number, future in enumerate(self.pending, start=len(self.asked) - len(self.pending) + 1):
            future.set_result(number)
        self.pending.clear()


def _leases(clock: _Clock, grants: _Grants) -> SharedLeases:
    return SharedLeases(cast(Store, grants), window_s=1.0, clock=clock, wall_ms=clock.wall_ms)


async def test_batches_within_a_window_share_one_lease_and_the_next_is_asked_for_ahead() -> None:
    clock = _Clock()
    grants = _Grants(clock)
    leases = _leases(clock, grants)
    first = await leases.lease_for(60)
    # The lease outlives a 60 s record by the window, in etcd's whole seconds.
    assert grants.asked == [(61, 100.0)]
    clock.now += 0.3
    assert await leases.lease_for(60) == first
    assert len(grants.asked) == 1
    # Past half the window the next grant is asked for, and the current lease still serves.
    clock.now += 0.3
    assert await leases.lease_for(60) == first
    await asyncio.sleep(0)
    assert len(grants.asked) == 2
    # Past the window the prefetched lease takes over without another grant.
    clock.now += 0.5
    second = await leases.lease_for(60)
    assert second != first and second.asked_at == pytest.approx(100.6)
    assert len(grants.asked) == 2
    # Another TTL has its own lease.
    other = await leases.lease_for(5)
    assert other not in (first, second) and grants.asked[-1] == (6, pytest.approx(101.1))
    # A lease asked for ahead and left unused through a quiet spell is not handed out.
    await leases.lease_for(60)
    clock.now += 0.6
    await leases.lease_for(60)
    await asyncio.sleep(0)
    clock.now += 120
    fresh = await leases.lease_for(60)
    assert fresh.asked_at == clock.now
    await leases.close()


async def test_a_grant_slower_than_the_window_serves_but_states_no_later_creation() -> None:
    clock = _Clock()
    grants = _Grants(clock, at_once=False)
    leases = _leases(clock, grants)
    waiting = asyncio.ensure_future(leases.lease_for(30))
    also_waiting = asyncio.ensure_future(leases.lease_for(30))
    for _ in range(3):
        await asyncio.sleep(0)
    assert len(grants.asked) == 1, "two batches waiting for a lease share one grant"
    clock.now += 2.5
    grants.answer_all()
    lease = await waiting
    assert await also_waiting == lease
    # Asked for at 100 s with 31 s: the record may say it was created at 101 s, not 102.5 s.
    assert leases.created_unix_ms(lease) == 101_000
    await leases.close()


async def test_a_failed_grant_fails_its_batch_and_the_next_batch_asks_again() -> None:
    clock = _Clock()
    grants = _Grants(clock)
    leases = _leases(clock, grants)
    grants.fail_next = True
    with pytest.raises(ConnectionError):
        await leases.lease_for(60)
    lease = await leases.lease_for(60)
    assert len(grants.asked) == 2
    # A grant asked for ahead that fails is asked for again, while the current lease still serves.
    clock.now += 0.6
    grants.fail_next = True
    assert await leases.lease_for(60) == lease
    await asyncio.sleep(0)
    assert len(grants.asked) == 3
    assert await leases.lease_for(60) == lease
    await asyncio.sleep(0)
    assert len(grants.asked) == 4
    clock.now += 0.5
    prefetched = await leases.lease_for(60)
    assert prefetched.asked_at == pytest.approx(100.6) and len(grants.asked) == 4
    # A lease etcd refused is not handed out again.
    leases.forget(prefetched.id)
    assert (await leases.lease_for(60)).id != prefetched.id
    await leases.close()


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.floats(min_value=0.0, max_value=1.7), min_size=1, max_size=40))
def test_every_record_stated_expiry_is_within_its_lease(steps: list[float]) -> None:
    """Whatever the spacing of batches, created + TTL <= the lease's earliest expiry (its grant
    asked for + the TTL it was granted with), and a batch waits for a grant only when the lease
    before it is past its window."""

    async def run() -> None:
        clock = _Clock()
        grants = _Grants(clock)
        leases = _leases(clock, grants)
        for step in steps:
            clock.now += step
            lease = await leases.lease_for(10)
            granted_ttl = next(ttl for ttl, when in grants.asked if int(when * 1000) == lease.asked_unix_ms)
            assert leases.created_unix_ms(lease) + 10_000 <= lease.asked_unix_ms + granted_ttl * 1000
            assert clock.now - lease.asked_at <= 1.0 + 1e-9
            await asyncio.sleep(0)
        await leases.close()

    asyncio.run(run())
