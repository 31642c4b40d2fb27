"""Stopping tasks reliably when a library may swallow a cancellation.

On Python 3.11, `asyncio.wait_for` returns the inner result instead of
raising when the cancellation races the inner call's completion; aetcd's
watch set-up uses it, so a watch task can survive one `cancel()` and go on
waiting for events. Cancelling again until the tasks are done (with a
deadline) makes shutdown and leadership hand-over dependable.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable
from typing import Any

import structlog

log = structlog.get_logger(__name__)


async def cancel_until_done(
    tasks: Iterable[asyncio.Task[Any]], deadline_s: float = 10.0
) -> set[asyncio.Task[Any]]:
    """Cancel `tasks` (again every 0.5 s) until all are done; returns those still running at the deadline."""
    pending = {t for t in tasks if not t.done()}
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while pending and loop.time() < end:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=min(0.5, max(0.0, end - loop.time())))
    if pending:
        log.error("tasks did not stop when cancelled", tasks=[t.get_name() for t in pending])
    return pending


async def run_all(*coros: Coroutine[Any, Any, None]) -> None:
    """Run coroutines as tasks until one fails or this is cancelled; then stop them all, reliably."""
    tasks = [asyncio.create_task(c) for c in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            exc = None if task.cancelled() else task.exception()
            if exc is not None:
                raise exc
    finally:
        await cancel_until_done(tasks)
