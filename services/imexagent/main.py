"""``cd-imex-agent``: the IMEX side of a node as one long-lived asyncio program.

It holds the node's liveness: the node record on its lease (`NodeRecordKeeper`), and runs the IMEX
daemons of the domains the node is in (`ImexSupervisor`). It is separate from the kubelet plugin
(``cd-node-agent``) so that a plugin restart or upgrade changes nothing in the store and no
daemon. A restart of this program adopts the running daemons (same pid; no job notices); by
default the daemons outlive it (``--stop-daemons-on-exit`` stops them).

Start order: health server -> etcd (retried: etcd may still be starting) -> node record keeper
and supervisor as background tasks. A background task that fails is logged, shown on ``/healthz``
and restarted with capped backoff; the problem clears once it has run for a while again.
Shutdown on SIGTERM/SIGINT (or `stop`): the tasks end (daemons left running unless configured).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from libs.hardware.errors import HardwareError
from libs.hardware.factory import open_node_hardware_from
from libs.hardware.interface import NodeHardware
from libs.runtime.health import Health
from libs.runtime.service import run_service, serving, stop_on_signals
from libs.runtime.tasks import keep_running
from libs.state.store import Store
from libs.state.watch import PrefixWatcher, watch_prefix
from services.imexagent.daemon_lifecycle import READY
from services.imexagent.daemon_supervisor import ImexSupervisor
from services.imexagent.node_record_keeper import NodeRecordKeeper, RecordKeeperSettings
from services.imexagent.settings import ImexAgentSettings, ImexSettings

log = structlog.get_logger(__name__)


@dataclass
class ImexAgent:
    """The IMEX side of one node: its record on the lease and its daemons."""

    record_keeper: NodeRecordKeeper
    supervisor: ImexSupervisor

    def tasks(self) -> list[tuple[str, Callable[[], Awaitable[object]]]]:
        """The background tasks to keep running (name, coroutine function)."""
        # "inventory" is the task's name on /healthz, which operators read: kept as it was.
        return [("inventory", self.record_keeper.run), ("imex-supervisor", self.supervisor.run)]

    async def run(self, health: Health) -> None:
        """Run both tasks (each restarted on failure) until cancelled."""
        self.record_keeper.health = health
        async with asyncio.TaskGroup() as group:
            for name, run in self.tasks():
                group.create_task(
                    keep_running(name, run, health), name=f"{name}-{self.record_keeper.node_name}"
                )


def compose_imex_agent(
    store: Store,
    node_name: str,
    hardware: NodeHardware,
    work_dir: Path,
    imex: ImexSettings,
    record: RecordKeeperSettings,
    watch: PrefixWatcher = watch_prefix,
) -> ImexAgent:
    """The IMEX agent's parts on a given store and hardware (``run_imex_agent`` and tools that
    host many simulated nodes in one process build it the same way)."""
    return ImexAgent(
        record_keeper=NodeRecordKeeper(store, node_name, hardware, record, watch=watch),
        supervisor=ImexSupervisor(store, node_name, hardware, work_dir, imex, watch=watch),
    )


class DaemonCollector(Collector):
    """Scrape-time gauges of the supervisor's daemons (nothing to keep in step)."""

    def __init__(self, supervisor: ImexSupervisor) -> None:
        self.supervisor = supervisor

    def collect(self) -> Iterator[GaugeMetricFamily]:
        restarts = GaugeMetricFamily(
            "cd_imex_daemon_restarts", "Restarts of this node's IMEX daemon, per domain.", labels=["cd_uid"]
        )
        ready = GaugeMetricFamily(
            "cd_imex_daemon_ready", "1 while this node's IMEX daemon is READY, per domain.", labels=["cd_uid"]
        )
        reloads = GaugeMetricFamily(
            "cd_imex_daemon_sigusr1",
            "SIGUSR1 sent to the current daemon supervision, per domain.",
            labels=["cd_uid"],
        )
        for runner in self.supervisor.runners():
            restarts.add_metric([runner.uid], runner.lifecycle.restarts)
            ready.add_metric([runner.uid], 1.0 if runner.lifecycle.state == READY else 0.0)
            reloads.add_metric([runner.uid], runner.sigusr1_sent)
        yield restarts
        yield ready
        yield reloads


async def _warn_until_registered(keeper: NodeRecordKeeper, warn_after_s: float = 30.0) -> None:
    """Log while the first registration takes long; the record keeper itself keeps the ``registered``
    readiness gate (open only while its record is in the store)."""
    while True:
        try:
            await keeper.wait_registered(warn_after_s)
        except TimeoutError:
            log.warning("node not registered in the store yet; waiting", node=keeper.node_name)
            continue
        return


async def run_imex_agent(
    settings: ImexAgentSettings,
    stop: asyncio.Event | None = None,
    imex: ImexSettings | None = None,
    handle_signals: bool = True,
) -> None:
    """Run until `stop` is set (or SIGTERM/SIGINT when `handle_signals`).

    `imex` replaces the daemon tuning derived from `settings` (tests and tools shorten timings)."""
    stop = stop_on_signals(stop) if handle_signals else stop or asyncio.Event()
    node_name = settings.node_name
    health = Health()
    health.set_ready("registered", False)
    registry = CollectorRegistry()
    hardware = open_node_hardware_from(settings)
    try:
        async with serving(settings, health, registry, gate="registered") as service:
            agent = compose_imex_agent(
                service.store,
                node_name,
                hardware,
                Path(settings.imex_work_dir),
                imex or settings.imex_settings(),
                RecordKeeperSettings(
                    lease_ttl_s=settings.lease_ttl_s,
                    node_ip=settings.node_ip,
                    kubelet_dir=settings.kubelet_dir,
                    cdi_root=settings.cdi_root,
                ),
            )
            registry.register(DaemonCollector(agent.supervisor))
            service.background.append(asyncio.create_task(agent.run(health), name=f"imex-agent-{node_name}"))
            log.info(
                "IMEX agent running",
                node=node_name,
                health_port=service.health_port,
                hardware=settings.hardware,
            )
            registered = asyncio.create_task(_warn_until_registered(agent.record_keeper))
            try:
                await stop.wait()
            finally:
                registered.cancel()
            log.info("shutting down", node=node_name)
    finally:
        hardware.close()
        log.info("IMEX agent stopped", node=node_name)


def main(argv: list[str] | None = None) -> None:
    run_service(
        ImexAgentSettings,
        argv,
        prog="cd-imex-agent",
        description="ComputeDomain IMEX agent (node record on its lease, IMEX daemons).",
        name="IMEX agent",
        run=run_imex_agent,
        fatal=(HardwareError, ValueError, OSError),
    )


if __name__ == "__main__":
    main()
