"""Hardware queries off the event loop, with a deadline, and at most one stuck at a time.

An NVML call can hang (a GPU falling off the bus, a driver wedged in a reset). Made on the event
loop it would stop everything the loop serves: the DRA socket, the node lease, the IMEX
supervision. `OffLoopCalls.call` runs the query in a thread of its own and gives up waiting after
`timeout_s` with `HardwareStalled`, a `HardwareError`, so callers report it like any failed query
(the node record's `fabric_message`, a health event).

A hung call cannot be cancelled; its thread stays blocked. So no second query starts while one is
still out: the next call waits for it within its own deadline (two callers share one instance:
the health poll and the node inventory, whose queries collide on a loaded machine), then fails,
saying how long the first has been stuck; queries resume once it returns. The threads are daemon threads: a process shutting down does not wait for
a call that never returns.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from libs.hardware.errors import HardwareError

T = TypeVar("T")


class HardwareStalled(HardwareError):
    """A hardware query did not return within its deadline (or an earlier one still has not)."""


class OffLoopCalls:
    def __init__(
        self, timeout_s: float, name: str = "hardware", clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"hardware query timeout must be > 0, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self.name = name
        self._clock = clock
        self._out: asyncio.Future[object] | None = None
        self._out_since = 0.0
        self._out_what = ""

    @property
    def stuck_for(self) -> float:
        """Seconds the call still out has been running (0 when none is)."""
        return self._clock() - self._out_since if self._out is not None and not self._out.done() else 0.0

    async def call(self, fn: Callable[[], T], what: str = "", timeout_s: float | None = None) -> T:
        """``fn()`` in a thread; `HardwareStalled` after `timeout_s` (default: the instance's), which
        covers waiting for an earlier call still out. Exceptions of ``fn`` are raised here."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        what = what or getattr(fn, "__name__", "query")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._out is not None and not self._out.done():
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise HardwareStalled(
                    f"{self.name} query {self._out_what} has not returned for {self.stuck_for:.0f}s "
                    "(hung driver?); no new query until it does"
                )
            # Another caller's query (not ours to cancel); its result or error is that caller's.
            await asyncio.wait({self._out}, timeout=remaining)
        left_s = max(deadline - loop.time(), 0.001)
        future: asyncio.Future[object] = loop.create_future()
        # A call that outlived its deadline may still fail; nobody awaits it then.
        future.add_done_callback(lambda f: f.cancelled() or f.exception())

        def run() -> None:
            try:
                result: object = fn()
            except BaseException as exc:  # handed to the awaiting task, whatever it is
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

        self._out, self._out_since, self._out_what = future, self._clock(), what
        threading.Thread(target=run, name=f"{self.name}-{what}", daemon=True).start()
        try:
            async with asyncio.timeout(left_s):
                result = await asyncio.shield(future)
        except TimeoutError:
            raise HardwareStalled(
                f"{self.name} query {what} did not answer within {timeout_s:g}s (hung driver?)"
            ) from None
        return result  # type: ignore[return-value]


def _settle(future: asyncio.Future[object], result: object, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
