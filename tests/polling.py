"""Waiting in tests and tools: poll a probe until it yields a value, or fail naming what was awaited.

One rule for every wait: a probe's result counts when it is neither None nor False. So a probe may
return the value it waited for (a record, a count that may be 0, a string that may be empty), or
True/False for a plain condition. A probe whose natural answer is another falsy value that must not
count (an empty list, "" meaning "nothing missing") says so at its call site, e.g. `... or None`.

`eventually` is the async wait. Its clock and sleep are injectable: where the code under test takes
a clock (`clock=` in services/ and libs/), a test passes one `VirtualClock` to both, so the wait
moves virtual time instead of waiting for the wall clock. `wait_until` is the synchronous wait for
tests and tools that drive real processes (etcd, the control plane, cdsim, kubelets) from
synchronous code; it uses the wall clock because those processes run on it.

A failure is a `PollTimeout` (an AssertionError) whose message names `what`, the timeout and the
text of `explain()` (a log tail, the last state seen), so that a timed-out wait says why.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar, cast, overload

T = TypeVar("T")

# Polls start fast (most conditions hold within a few event-loop turns) and back off to a cap, so a
# long wait costs few probes and a short one little latency.
FIRST_DELAY_S = 0.01
MAX_DELAY_S = 0.5
BACKOFF_FACTOR = 1.5


class PollTimeout(AssertionError):
    """A waited-for condition did not come about within its timeout."""


def counts(value: object) -> bool:
    """The success rule: a result other than None and False."""
    return value is not None and value is not False


def timeout_message(what: str, timeout_s: float, explain: Callable[[], str] | None) -> str:
    message = f"timed out after {timeout_s:g} s waiting for {what}"
    if explain is not None:
        try:
            detail = explain()
        except Exception as exc:  # the explanation must not hide the timeout
            detail = f"(explain failed: {exc!r})"
        if detail:
            message += f"\n{detail}"
    return message


def _next_delay(delay: float, max_delay_s: float) -> float:
    return min(delay * BACKOFF_FACTOR, max_delay_s)


@overload
async def eventually(
    probe: Callable[[], Awaitable[T | None]],
    what: str,
    timeout_s: float = ...,
    *,
    explain: Callable[[], str] | None = ...,
    first_delay_s: float = ...,
    max_delay_s: float = ...,
    clock: Callable[[], float] = ...,
    sleep: Callable[[float], Awaitable[object]] = ...,
) -> T: ...


@overload
async def eventually(
    probe: Callable[[], T | None],
    what: str,
    timeout_s: float = ...,
    *,
    explain: Callable[[], str] | None = ...,
    first_delay_s: float = ...,
    max_delay_s: float = ...,
    clock: Callable[[], float] = ...,
    sleep: Callable[[float], Awaitable[object]] = ...,
) -> T: ...


async def eventually(
    probe: Callable[[], object],
    what: str,
    timeout_s: float = 10.0,
    *,
    explain: Callable[[], str] | None = None,
    first_delay_s: float = FIRST_DELAY_S,
    max_delay_s: float = MAX_DELAY_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
) -> object:
    """Await `probe()` (plain or async) until it counts (see the module); return that value.

    The probe runs at least once, also with a timeout of 0, and once more at the deadline, so a
    condition that comes about during the last sleep is not reported as a timeout.
    """
    deadline = clock() + timeout_s
    delay = first_delay_s
    while True:
        result = probe()
        if inspect.isawaitable(result):
            result = await result
        if counts(result):
            return result
        remaining = deadline - clock()
        if remaining <= 0:
            raise PollTimeout(timeout_message(what, timeout_s, explain))
        await sleep(min(delay, remaining))
        delay = _next_delay(delay, max_delay_s)


def wait_until(
    probe: Callable[[], T | None],
    what: str,
    timeout_s: float,
    *,
    explain: Callable[[], str] | None = None,
    first_delay_s: float = 0.05,
    max_delay_s: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], object] = time.sleep,
) -> T:
    """Call `probe()` until it counts (see the module); return that value.

    Synchronous and on the wall clock, because the callers wait for real processes (which run on
    the wall clock) from synchronous code. Async tests use `eventually`.
    """
    deadline = clock() + timeout_s
    delay = first_delay_s
    while True:
        result = probe()
        if counts(result):
            return cast(T, result)
        remaining = deadline - clock()
        if remaining <= 0:
            raise PollTimeout(timeout_message(what, timeout_s, explain))
        sleep(min(delay, remaining))
        delay = _next_delay(delay, max_delay_s)


class VirtualClock:
    """Time that moves only when a test sleeps on it.

    Pass the clock itself as the `clock=` of the code under test and of `eventually`, and its
    `sleep` as `eventually`'s sleep: each poll then advances virtual time by its backoff delay and
    lets the event loop run the code under test, which sees the time move without waiting for it.
    """

    def __init__(self, start_s: float = 1_000.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock does not go back: advance({seconds})")
        self.now_s += seconds

    async def sleep(self, seconds: float) -> None:
        self.advance(seconds)
        # Several turns, so that work the time change wakes (a task that awaits another) runs.
        for _ in range(5):
            await asyncio.sleep(0)
