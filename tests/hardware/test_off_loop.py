"""Hardware queries off the event loop: a hung one times out, and no second one piles up behind it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from libs.hardware.errors import HardwareError
from libs.hardware.off_loop import HardwareStalled, OffLoopCalls


async def test_a_hung_query_times_out_and_blocks_no_second_thread() -> None:
    calls = OffLoopCalls(0.2, name="nvml")
    release = threading.Event()
    started: list[float] = []

    def hang() -> str:
        started.append(time.monotonic())
        release.wait(10)
        return "late"

    loop_ticks = 0

    async def ticker() -> None:
        nonlocal loop_ticks
        while True:
            await asyncio.sleep(0.01)
            loop_ticks += 1

    tick = asyncio.create_task(ticker())
    try:
        with pytest.raises(HardwareStalled, match=r"nvml query hang did not answer within 0.2s"):
            await calls.call(hang)
        assert loop_ticks >= 10, "the loop kept running while the query hung"
        with pytest.raises(HardwareStalled, match="has not returned for"):
            await calls.call(hang)
        assert len(started) == 1, "no second query while the first is still out"
        release.set()
        for _ in range(100):
            if calls.stuck_for == 0:
                break
            await asyncio.sleep(0.01)
        assert await calls.call(lambda: "fresh", "ok") == "fresh"
    finally:
        tick.cancel()


async def test_a_second_caller_waits_for_a_slow_query_instead_of_failing() -> None:
    # The health poll and the node inventory share one instance: on a loaded machine the
    # inventory's query often starts while the poll's is still out. It must get its own answer,
    # not a "hung driver" error that would stay in the node record.
    calls = OffLoopCalls(2.0)
    release = threading.Event()

    def slow() -> str:
        release.wait(5)
        return "poll"

    poll = asyncio.create_task(calls.call(slow, "snapshot"))
    await asyncio.sleep(0.05)
    second = asyncio.create_task(calls.call(lambda: "inventory", "snapshot"))
    await asyncio.sleep(0.1)
    assert not second.done(), "the second caller waits while the first query is out"
    release.set()
    assert await second == "inventory"
    assert await poll == "poll"


async def test_a_query_error_is_raised_to_the_caller() -> None:
    calls = OffLoopCalls(1.0)

    def broken() -> None:
        raise HardwareError("NVML_ERROR_GPU_IS_LOST")

    with pytest.raises(HardwareError, match="GPU_IS_LOST"):
        await calls.call(broken)
    assert await calls.call(lambda: 7) == 7


def test_a_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="timeout must be > 0"):
        OffLoopCalls(0)
