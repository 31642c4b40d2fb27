"""The controller's work queue: dedup, one worker per item, rate-limited requeue."""

from __future__ import annotations

import asyncio

import pytest

from services.controller.workqueue import ItemBackoff, QueueShutDown, WorkQueue


async def test_items_added_many_times_are_processed_once() -> None:
    q: WorkQueue[str] = WorkQueue()
    for _ in range(5):
        q.add("d1")
    q.add("d2")
    assert len(q) == 2
    assert await q.get() == "d1"
    assert await q.get() == "d2"
    assert len(q) == 0


async def test_item_added_while_processing_is_requeued_after_done_not_handed_out_twice() -> None:
    q: WorkQueue[str] = WorkQueue()
    q.add("d1")
    item = await q.get()
    q.add("d1")  # an event arrives while a worker holds d1
    assert len(q) == 0, "d1 must not reach a second worker while the first one holds it"
    q.done(item)
    assert len(q) == 1 and await q.get() == "d1"


async def test_waiting_workers_are_woken_by_add() -> None:
    q: WorkQueue[int] = WorkQueue()
    got: list[int] = []

    async def worker() -> None:
        while True:
            item = await q.get()
            got.append(item)
            q.done(item)

    tasks = [asyncio.create_task(worker()) for _ in range(3)]
    await asyncio.sleep(0.01)
    for i in range(100):
        q.add(i)
    await asyncio.sleep(0.05)
    assert sorted(got) == list(range(100))
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_rate_limited_requeue_backs_off_per_item_and_forget_resets() -> None:
    q: WorkQueue[str] = WorkQueue(ItemBackoff(base_s=0.02, cap_s=0.08))
    assert [q.backoff.when("x") for _ in range(5)] == [0.02, 0.04, 0.08, 0.08, 0.08]
    q.forget("x")
    q.add_rate_limited("x")
    assert len(q) == 0
    await asyncio.sleep(0.05)
    assert len(q) == 1


async def test_add_after_keeps_the_earlier_deadline() -> None:
    q: WorkQueue[str] = WorkQueue()
    q.add_after("x", 0.02)
    q.add_after("x", 5.0)
    await asyncio.sleep(0.05)
    assert len(q) == 1


async def test_shutdown_releases_waiting_workers_and_clear_drops_delayed() -> None:
    q: WorkQueue[str] = WorkQueue()
    q.add_after("late", 0.01)
    q.clear()
    await asyncio.sleep(0.03)
    assert len(q) == 0
    waiter = asyncio.create_task(q.get())
    await asyncio.sleep(0.01)
    q.shutdown()
    with pytest.raises(QueueShutDown):
        await asyncio.wait_for(waiter, 1)


async def test_paced_item_is_coalesced_until_its_gap_ends_and_others_are_not_held_up() -> None:
    """busy_share 0.25: after 40 ms of computing an item waits ~120 ms; the adds meanwhile make one run."""
    q: WorkQueue[str] = WorkQueue(busy_share=0.25)
    loop = asyncio.get_running_loop()
    q.add("big")
    assert await q.get() == "big"
    q.add("big")  # events while it ran
    q.done("big", busy_s=0.04)
    done_at = loop.time()
    for _ in range(50):
        q.add("big")  # a burst of events after it
    q.add("small")
    assert len(q) == 1 and await q.get() == "small", "another item is not delayed by big's gap"
    q.done("small", busy_s=0.0002)
    assert await q.get() == "big"
    waited = loop.time() - done_at
    assert 0.10 <= waited < 0.5, f"big taken again after {waited:.3f} s, expected ~0.12 s"
    assert len(q) == 0, "the 51 adds were coalesced into one run"
    q.done("big")


async def test_pacing_follows_computing_time_not_time_spent_waiting() -> None:
    """A reconcile that waited 50 ms on I/O but computed for 0.1 ms is not held back."""
    q: WorkQueue[str] = WorkQueue(busy_share=0.25)
    q.add("d1")
    await q.get()
    await asyncio.sleep(0.05)
    q.add("d1")
    q.done("d1", busy_s=0.0001)
    await asyncio.sleep(0.002)
    assert len(q) == 1 and await q.get() == "d1"


async def test_unpaced_queue_hands_a_requeued_item_out_at_once() -> None:
    q: WorkQueue[str] = WorkQueue()
    q.add("d1")
    await q.get()
    await asyncio.sleep(0.02)
    q.add("d1")
    q.done("d1")
    assert len(q) == 1


def test_busy_share_outside_its_range_is_refused() -> None:
    with pytest.raises(ValueError, match="busy_share"):
        WorkQueue(busy_share=0.0)
