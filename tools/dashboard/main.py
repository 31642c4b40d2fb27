"""The dashboard as a program: `python -m tools.dashboard [--state-dir DIR | --etcd-endpoint H:P]`.

`cdsim up` runs it for every simulated cluster (see tools.dashboard.cdsim_hook); run it by hand
to watch any deployment's store.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import structlog
from aiohttp import web

from libs.runtime.health import Health, start_health_server
from libs.runtime.logging import configure_logging
from libs.runtime.settings import load_settings_or_exit
from libs.state.config import EtcdConfig
from libs.state.store import Store
from tools.cdsim.credentials import Credentials, of_run
from tools.cdsim.layout import StateLayout
from tools.cdsim.run_state import RunState
from tools.dashboard.feed import DashboardFeed
from tools.dashboard.metrics import DashboardMetrics
from tools.dashboard.model import RESOURCES, DashboardView
from tools.dashboard.server import add_routes
from tools.dashboard.settings import DEFAULT_ETCD_ENDPOINT, ENV_PREFIX, DashboardSettings
from tools.sim.hardware.cluster import ClusterDescription

log = structlog.get_logger(__name__)

_STOP_TIMEOUT_S = 5.0


class DashboardConfigError(ValueError):
    """The settings do not say where the store is or what to draw; the message says why."""


@dataclass(frozen=True)
class Target:
    endpoint: str
    cluster: ClusterDescription | None
    # The state dir's client certificates when its cluster runs secured (tools.cdsim.credentials).
    credentials: Credentials | None = None

    def etcd_config(self, settings: DashboardSettings) -> EtcdConfig:
        """TLS settings given explicitly win over the state dir's certificates."""
        if self.credentials is None or settings.etcd_ca_file:
            return settings.etcd_config(self.endpoint)
        config = self.credentials.etcd_config(self.endpoint, prefix=settings.etcd_prefix)
        return replace(config, timeout_s=settings.etcd_timeout_s)


def resolve_target(settings: DashboardSettings) -> Target:
    """The etcd endpoint and rack layout, from explicit settings or a cdsim state directory."""
    endpoint = settings.etcd_endpoint
    cluster_file = settings.sim_cluster
    credentials = None
    if settings.state_dir:
        layout = StateLayout.at(settings.state_dir)
        if not endpoint:
            state = RunState.load(layout)
            if state is None or not state.etcd_endpoint:
                raise DashboardConfigError(
                    f"no cdsim cluster runs in {layout.root}; start one with `cdsim up` or pass --etcd-endpoint"
                )
            endpoint = state.etcd_endpoint
            credentials = of_run(state)
        cluster_file = cluster_file or str(layout.cluster_file)
    cluster = None
    if cluster_file:
        try:
            cluster = ClusterDescription.load(Path(cluster_file))
        except (OSError, ValueError) as exc:
            raise DashboardConfigError(f"cannot read the cluster description {cluster_file}: {exc}") from None
    return Target(endpoint or DEFAULT_ETCD_ENDPOINT, cluster, credentials)


async def _cancel_all(tasks: list[asyncio.Task[None]], timeout_s: float) -> None:
    """Cancel tasks and wait for them, cancelling again while any is left.

    One cancel is not always enough: on Python 3.11 an `asyncio.wait_for` deep in a library (aetcd
    creating a watch) can swallow it, and the watch then retries as if the call had failed.
    """
    pending = {t for t in tasks if not t.done()}
    deadline = asyncio.get_running_loop().time() + timeout_s
    while pending and asyncio.get_running_loop().time() < deadline:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.2)
    if pending:
        log.warning("dashboard tasks did not stop", tasks=[t.get_name() for t in pending])


class DashboardService:
    """Store watches + the HTTP server; `start()` returns once it listens, `stop()` undoes it."""

    def __init__(self, settings: DashboardSettings, target: Target) -> None:
        self.settings = settings
        self.store = Store(target.etcd_config(settings))
        self.metrics = DashboardMetrics()
        self.view = DashboardView(
            self.store.keys, target.cluster, settings.title, clock_ms=lambda: int(time.time() * 1000)
        )
        self.feed = DashboardFeed(self.store, self.view, self.metrics)
        self.health = Health()
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.port}/"

    async def start(self) -> int:
        await self.store.connect()
        self.health.set_ready("synced", False)
        self._tasks = self.feed.start()
        for task in self._tasks:
            self.health.watch_task(task.get_name(), task)
        self._tasks.append(asyncio.create_task(self._mark_ready(), name="dashboard-ready"))
        self._runner, self.port = await start_health_server(
            self.health,
            self.settings.host,
            self.settings.port,
            self.metrics.registry,
            add_routes(self.feed, self.settings.keepalive_s),
        )
        log.info("dashboard listening", url=self.url, etcd=self.store.config.endpoint)
        return self.port

    async def _mark_ready(self) -> None:
        version = -1
        while len(self.view.synced) < len(RESOURCES) and not self.feed.closed:
            await self.feed.wait_newer(version, timeout_s=1.0)
            version = self.view.version
        self.health.set_ready("synced", True)

    async def stop(self) -> None:
        self.feed.close()
        if self._runner is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._runner.cleanup(), timeout=_STOP_TIMEOUT_S)
        await _cancel_all(self._tasks, _STOP_TIMEOUT_S)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.store.close(), timeout=_STOP_TIMEOUT_S)


async def _amain(settings: DashboardSettings, target: Target) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    service = DashboardService(settings, target)
    await service.start()
    try:
        await stop.wait()
    finally:
        await service.stop()


def main(argv: Sequence[str] | None = None) -> None:
    settings = load_settings_or_exit(
        DashboardSettings,
        argv,
        env_prefix=ENV_PREFIX,
        prog="cd-dashboard",
        description="Live web dashboard of ComputeDomains: racks of trays coloured by domain",
    )
    configure_logging(settings.log_format, settings.log_level)  # type: ignore[arg-type]
    try:
        target = resolve_target(settings)
    except DashboardConfigError as exc:
        print(f"cd-dashboard: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        asyncio.run(_amain(settings, target))
    except OSError as exc:  # the port is taken, ...
        log.error("dashboard cannot run", error=str(exc))
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
