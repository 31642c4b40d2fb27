"""`cd-controller`: the domain controller process.

Every replica watches the store and keeps a warm view; the one holding the
leader lease reconciles (and, in Kubernetes mode, runs the ComputeDomain
adapter). SIGTERM resigns at once: the leader lease is revoked so a standby
takes over without waiting for the TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import structlog

from libs.runtime.cancellation import cancel_until_done
from libs.runtime.health import Health, start_health_server
from libs.runtime.service import run_service, stop_on_signals
from libs.state.election import LeaderElection, Leadership
from libs.state.store import Store, with_retries
from services.controller.metrics import ControllerMetrics
from services.controller.reconciler import DomainReconciler, ReconcilerConfig
from services.controller.settings import ControllerSettings

log = structlog.get_logger(__name__)

# How long shutdown waits for each part to stop before giving up on it.
_STOP_TIMEOUT_S = 5.0


class ControllerService:
    """One controller replica: view, leader election, reconciler, health server."""

    def __init__(self, settings: ControllerSettings, metrics: ControllerMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or ControllerMetrics()
        self.health = Health()
        self.store = Store(settings.etcd_config())
        self.reconciler = DomainReconciler(
            self.store,
            self.metrics,
            ReconcilerConfig(
                workers=settings.workers,
                orphan_grace_s=settings.orphan_grace_s,
                resync_period_s=settings.resync_period_s,
                busy_share=settings.reconcile_busy_share,
                mesh_tls=settings.imex_mesh_tls,
                mesh_certificate_validity_s=settings.imex_mesh_certificate_validity_s,
            ),
        )
        self.election = LeaderElection(
            self.store, settings.leader_election_name, settings.holder, ttl_s=settings.leader_lease_ttl_s
        )
        self.leadership: Leadership | None = None
        self.health_port: int | None = None

    async def _lead(self, leadership: Leadership) -> None:
        self.leadership = leadership
        self.metrics.leader.set(1)
        self.metrics.leader_takeovers.inc()
        log.info("leading", holder=leadership.holder, mode=self.settings.mode)
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self.reconciler.lead(leadership))
                if self.settings.mode == "kubernetes":
                    # Imported here: simulation mode needs no Kubernetes client at all.
                    from services.controller.kube.adapter import KubeAdapter

                    adapter = await KubeAdapter.create(
                        self.store,
                        self.reconciler,
                        self.settings.kubeconfig,
                        self.settings.sweep_interval_s,
                        identity=leadership.holder,
                    )
                    tg.create_task(adapter.run(leadership))
        finally:
            self.metrics.leader.set(0)
            self.leadership = None

    async def _wait_synced(self) -> None:
        await self.reconciler.synced.wait()
        self.health.set_ready("view-synced", True)

    async def run(self, stop: asyncio.Event) -> None:
        self.health.set_ready("view-synced", False)
        await with_retries(self.store.connect, "connect to etcd", deadline_s=60.0)
        runner, self.health_port = await start_health_server(
            self.health, self.settings.health_host, self.settings.health_port, self.metrics.registry
        )
        tasks: list[asyncio.Task[None]] = []
        try:
            for name, coro in (
                ("watch", self.reconciler.watch()),
                ("election", self.election.run(self._lead)),
                ("synced", self._wait_synced()),
            ):
                task = asyncio.create_task(coro, name=name)
                if name != "synced":
                    self.health.watch_task(name, task)
                tasks.append(task)
            await stop.wait()
            log.info("stopping", leader=self.leadership is not None)
        finally:
            await self._shutdown(tasks)
            await runner.cleanup()

    async def _shutdown(self, tasks: list[asyncio.Task[None]]) -> None:
        held = self.leadership
        # Stop acting first, then hand over: revoking the lease deletes the leader key at once.
        await cancel_until_done(tasks, _STOP_TIMEOUT_S)
        if held is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(_STOP_TIMEOUT_S):
                    await self.store.revoke_lease(held.lease_id)
            log.info("leadership resigned", holder=held.holder)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(_STOP_TIMEOUT_S):
                await self.store.close()


async def _amain(settings: ControllerSettings) -> None:
    await ControllerService(settings).run(stop_on_signals())


def _log_start(settings: ControllerSettings) -> None:
    log.info(
        "cd-controller starting",
        identity=settings.holder,
        mode=settings.mode,
        etcd=settings.endpoint_list(),
        prefix=settings.etcd_prefix,
        leader_lease_ttl_s=settings.leader_lease_ttl_s,
    )


def main(argv: Sequence[str] | None = None) -> None:
    run_service(
        ControllerSettings,
        argv,
        prog="cd-controller",
        description="ComputeDomain domain controller",
        name="controller",
        run=_amain,
        on_start=_log_start,
    )


if __name__ == "__main__":
    main()
