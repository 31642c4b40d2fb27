"""Leader election against a real etcd."""

from __future__ import annotations

import asyncio
import time

from libs.gen.computedomain.state import v1 as pb
from libs.state.election import LeaderElection, Leadership
from libs.state.store import Put, Store


async def test_one_leader_then_takeover_within_ttl_and_fencing(store: Store) -> None:
    leaders: list[str] = []
    terms: dict[str, Leadership] = {}
    b_leads = asyncio.Event()

    def lead_as(name: str):  # type: ignore[no-untyped-def]
        async def lead(leadership: Leadership) -> None:
            leaders.append(name)
            terms[name] = leadership
            if name == "b":
                b_leads.set()
            await asyncio.Event().wait()

        return lead

    ttl = 2
    a = LeaderElection(store, "controller", "a", ttl_s=ttl)
    b = LeaderElection(store, "controller", "b", ttl_s=ttl)
    task_a = asyncio.create_task(a.run(lead_as("a")))
    await asyncio.sleep(0.3)
    task_b = asyncio.create_task(b.run(lead_as("b")))
    await asyncio.sleep(0.5)
    assert leaders == ["a"] and a.is_leader and not b.is_leader
    assert await b.current_leader() == "a"

    # "a" dies without resigning (no revoke): its lease must expire first.
    task_a.cancel()
    died = time.monotonic()
    await asyncio.wait_for(b_leads.wait(), timeout=ttl + 3)
    takeover = time.monotonic() - died
    assert leaders == ["a", "b"]
    assert takeover <= ttl + 1.5, takeover

    # A write fenced on the old term fails; one fenced on the new term lands.
    key = store.keys.domain("fenced")
    stale = await store.txn([terms["a"].fence], [Put(key, pb.ComputeDomain(uid="fenced", name="stale"))])
    fresh = await store.txn([terms["b"].fence], [Put(key, pb.ComputeDomain(uid="fenced", name="fresh"))])
    assert not stale.succeeded and fresh.succeeded
    got = await store.get(key, pb.ComputeDomain)
    assert got is not None and got.value.name == "fresh"
    task_b.cancel()
    await asyncio.gather(task_a, task_b, return_exceptions=True)
