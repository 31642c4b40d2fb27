"""Background tasks that must never end: restarted with backoff, their failures shown in health."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from libs.runtime.backoff import Backoff
from libs.runtime.health import Health

log = structlog.get_logger(__name__)

# A restarted background task that then runs this long counts as recovered.
_STABLE_AFTER_S = 60.0


async def keep_running(
    name: str,
    run: Callable[[], Awaitable[object]],
    health: Health,
    stable_after_s: float = _STABLE_AFTER_S,
    backoff: Backoff | None = None,
) -> None:
    """Run a task that should never end; on failure log, report in health, restart with backoff.
    The health problem clears once the restarted task has run ``stable_after_s``."""
    loop = asyncio.get_running_loop()
    backoff = backoff or Backoff(initial=0.5, cap=30.0)
    problem = f"task:{name}"
    while True:
        started = loop.time()
        recovered = (
            loop.call_later(stable_after_s, health.clear_problem, problem)
            if problem in health.problems
            else None
        )
        try:
            await run()
            message = "exited unexpectedly"
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
            log.exception("background task failed; restarting", task=name)
        finally:
            if recovered is not None:
                recovered.cancel()
        if loop.time() - started >= stable_after_s:
            backoff.reset()
        health.set_problem(problem, message)
        await asyncio.sleep(backoff.next_delay())
        log.info("restarting background task", task=name)
