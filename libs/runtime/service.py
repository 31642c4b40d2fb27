"""The entry point every long-running service shares: settings from flags and environment,
logging, a stop event that SIGTERM and SIGINT set, and a clean exit when it cannot start.

A service supplies its settings class and ``run(settings)``; ``run`` returns once its stop
event is set and everything it opened is closed. A failure the operator must fix (a bad
setting, missing hardware, a port or socket in use) is logged as one line, exit status 1, with
no traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeVar

import structlog

from libs.runtime.logging import configure_logging
from libs.runtime.settings import load_settings_or_exit

log = structlog.get_logger(__name__)


class ServiceSettings(Protocol):
    @property
    def log_format(self) -> str: ...

    @property
    def log_level(self) -> str: ...


S = TypeVar("S", bound=ServiceSettings)


def stop_on_signals(stop: asyncio.Event | None = None) -> asyncio.Event:
    """``stop`` (a new event when None), set by SIGTERM and SIGINT; call it on the running loop."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def run_service(
    settings_class: type[S],
    argv: Sequence[str] | None,
    *,
    prog: str,
    description: str,
    name: str,
    run: Callable[[S], Awaitable[None]],
    fatal: tuple[type[BaseException], ...],
) -> None:
    """Load ``settings_class`` (exit 2 on a bad setting), configure logging, run ``run`` to its
    end; a ``fatal`` exception is logged as "<name> cannot run" and exits 1."""
    settings = load_settings_or_exit(settings_class, argv, prog=prog, description=description)
    configure_logging(settings.log_format, settings.log_level)  # type: ignore[arg-type]
    try:
        asyncio.run(_complete(run(settings)))
    except fatal as exc:
        log.error(f"{name} cannot run", error=str(exc))
        sys.exit(1)


async def _complete(work: Awaitable[None]) -> None:
    await work
