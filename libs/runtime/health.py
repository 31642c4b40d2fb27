"""The side HTTP server every service runs: /healthz, /readyz, /metrics.

Background tasks register with `Health`; a task that dies marks the service
unhealthy with its error, so a failure never goes unnoticed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import prometheus_client
import structlog
from aiohttp import web

log = structlog.get_logger(__name__)


@dataclass
class Health:
    """Liveness problems and readiness gates of one service."""

    problems: dict[str, str] = field(default_factory=dict)
    ready_gates: dict[str, bool] = field(default_factory=dict)
    # Shown on /healthz without failing it: trouble a restart would not cure (a hung driver),
    # where a liveness restart would only cost more (an IMEX agent's container takes its daemons).
    warnings: dict[str, str] = field(default_factory=dict)
    started_at: float = field(default_factory=time.monotonic)

    def set_warning(self, name: str, message: str) -> None:
        self.warnings[name] = message

    def clear_warning(self, name: str) -> None:
        self.warnings.pop(name, None)

    def set_problem(self, name: str, message: str) -> None:
        self.problems[name] = message

    def clear_problem(self, name: str) -> None:
        self.problems.pop(name, None)

    def set_ready(self, gate: str, ready: bool) -> None:
        self.ready_gates[gate] = ready

    @property
    def healthy(self) -> bool:
        return not self.problems

    @property
    def ready(self) -> bool:
        return self.healthy and all(self.ready_gates.values())

    def watch_task(self, name: str, task: asyncio.Task[object]) -> None:
        """Record the failure of a background task that should never end."""

        def _done(t: asyncio.Task[object]) -> None:
            if t.cancelled():
                return
            exc = t.exception()
            message = f"{type(exc).__name__}: {exc}" if exc else "exited unexpectedly"
            log.error("background task ended", task=name, error=message)
            self.set_problem(f"task:{name}", message)

        task.add_done_callback(_done)

    def report(self) -> dict[str, object]:
        return {
            "healthy": self.healthy,
            "ready": self.ready,
            "problems": dict(self.problems),
            "warnings": dict(self.warnings),
            "gates": dict(self.ready_gates),
            "uptime_s": round(time.monotonic() - self.started_at, 3),
        }


def build_health_app(
    health: Health,
    registry: prometheus_client.CollectorRegistry | None = None,
    extra_routes: Callable[[web.Application], None] | None = None,
) -> web.Application:
    reg = registry or prometheus_client.REGISTRY

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response(health.report(), status=200 if health.healthy else 503)

    async def readyz(_: web.Request) -> web.Response:
        return web.json_response(health.report(), status=200 if health.ready else 503)

    async def metrics(_: web.Request) -> web.Response:
        body = prometheus_client.generate_latest(reg)
        return web.Response(body=body, headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    if extra_routes is not None:
        extra_routes(app)
    return app


async def start_health_server(
    health: Health,
    host: str,
    port: int,
    registry: prometheus_client.CollectorRegistry | None = None,
    extra_routes: Callable[[web.Application], None] | None = None,
) -> tuple[web.AppRunner, int]:
    """Start the side server; returns the runner (call `cleanup()` on exit) and the bound port."""
    runner = web.AppRunner(build_health_app(health, registry, extra_routes), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = port
    server: Any = site._server  # aiohttp exposes the bound socket only here
    if port == 0 and server is not None and getattr(server, "sockets", None):
        bound = server.sockets[0].getsockname()[1]
    log.info("health server listening", host=host, port=bound)
    return runner, bound


ShutdownHook = Callable[[], Awaitable[None]]
