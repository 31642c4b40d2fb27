"""The entry point every long-running service shares: settings from flags and environment,
logging, a stop event that SIGTERM and SIGINT set, and a clean exit when it cannot start.

A service supplies its settings class and ``run(settings)``; ``run`` returns once its stop
event is set and everything it opened is closed. A failure the operator must fix (a bad
setting, missing hardware, a port or socket in use) is logged as one line, exit status 1, with
no traceback; anything else is a bug and keeps its traceback.

`serving` is the skeleton the node programs share around their own parts: the health server,
the store connection (retried: etcd may still be starting), background tasks, and their
shutdown in reverse.
"""

from __future__ import annotations

import asyncio
import inspect
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import structlog
from prometheus_client import CollectorRegistry

from libs.runtime.health import Health, start_health_server
from libs.runtime.logging import configure_logging
from libs.runtime.settings import load_settings_or_exit
from libs.runtime.tasks import keep_running
from libs.state.config import EtcdConfig
from libs.state.store import Store, with_retries

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
    fatal: tuple[type[BaseException], ...] = (),
    env_prefix: str | None = None,
    on_start: Callable[[S], None] | None = None,
    loop_factory: Callable[[S], Callable[[], asyncio.AbstractEventLoop] | None] | None = None,
) -> None:
    """Load ``settings_class`` (exit 2 on a bad setting), configure logging, call ``on_start``
    (a service's start line), run ``run`` to its end on the loop ``loop_factory`` picks (default:
    asyncio's); a ``fatal`` exception is logged as "<name> cannot run" and exits 1."""
    prefix = {} if env_prefix is None else {"env_prefix": env_prefix}
    settings = load_settings_or_exit(settings_class, argv, prog=prog, description=description, **prefix)
    configure_logging(settings.log_format, settings.log_level)  # type: ignore[arg-type]
    if on_start is not None:
        on_start(settings)
    factory = loop_factory(settings) if loop_factory is not None else None
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(_complete(run(settings)))
    except fatal as exc:
        log.error(f"{name} cannot run", error=str(exc))
        sys.exit(1)


async def _complete(work: Awaitable[None]) -> None:
    await work


class ServingSettings(Protocol):
    """What `serving` reads: the health server's address and the etcd settings."""

    @property
    def health_host(self) -> str: ...

    @property
    def health_port(self) -> int: ...

    @property
    def etcd_timeout_s(self) -> float: ...

    def etcd_config(self) -> EtcdConfig: ...


@dataclass
class Serving:
    """What `serving` set up: the store, the health server's port, the background tasks."""

    health: Health
    store: Store
    health_port: int = 0
    background: list[asyncio.Task[None]] = field(default_factory=list)
    closers: list[Callable[[], object]] = field(default_factory=list)

    def spawn(self, name: str, run: Callable[[], Awaitable[object]]) -> None:
        """Keep `run` running (failures logged, shown on health, restarted with backoff)."""
        self.background.append(asyncio.create_task(keep_running(name, run, self.health), name=name))

    def close_after_tasks(self, close: Callable[[], object]) -> None:
        """Call (and await) `close` once the background tasks ended, before the store closes."""
        self.closers.append(close)


@asynccontextmanager
async def serving(
    settings: ServingSettings, health: Health, registry: CollectorRegistry, *, gate: str
) -> AsyncIterator[Serving]:
    """Health server up, then the store connected; on the way out the `gate` readiness closes,
    the background tasks end, then the closers run, the health server and the store close."""
    service = Serving(health, Store(settings.etcd_config()))
    runner = None
    try:
        runner, service.health_port = await start_health_server(
            health, settings.health_host, settings.health_port, registry
        )
        # etcd may still be starting (or restarting) when the program comes up: retry, do not exit.
        await with_retries(
            service.store.connect, what="connect to etcd", deadline_s=settings.etcd_timeout_s * 12
        )
        yield service
    finally:
        health.set_ready(gate, False)
        for task in service.background:
            task.cancel()
        await asyncio.gather(*service.background, return_exceptions=True)
        for close in service.closers:
            result = close()
            if inspect.isawaitable(result):
                await result
        if runner is not None:
            await runner.cleanup()
        await service.store.close()
