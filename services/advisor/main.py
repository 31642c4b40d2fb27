"""`cd-placement-advisor`: the PlacementAdvisor gRPC service and the kube-scheduler extender.

One process: the store-fed fleet index, gRPC on TCP (and/or a unix socket) with the standard
health and reflection services beside the API, the extender over HTTP (with the reaper that
releases its reservations once bound or once their domain is gone), and the /healthz,
/readyz, /metrics side server. Ready once
the fleet index has listed the store. SIGTERM/SIGINT stop the listeners, let
in-flight calls finish (bounded), then stop the watches.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
from collections.abc import Callable, Sequence
from typing import Any

import structlog
from aiohttp import web
from grpclib.health.check import ServiceStatus
from grpclib.server import Server

from libs.runtime.cancellation import cancel_until_done
from libs.runtime.grpc_limits import ServerLimits
from libs.runtime.health import Health, start_health_server
from libs.runtime.service import run_service, stop_on_signals
from libs.state.store import Store, with_retries
from services.advisor.advisor import Advisor, AdvisorConfig
from services.advisor.auth import server_tls_context, track_client_identity
from services.advisor.domain_placement import EXTENDER_HOLDER_PREFIX, DomainPlacer
from services.advisor.domain_presence import DomainPresence
from services.advisor.domain_sources import (
    CachedTemplateSource,
    KubeTemplateSource,
    StoreDomainSizes,
    StoreTemplateSource,
    TemplateDomainSource,
)
from services.advisor.extender import CappedAppRunner, Extender, build_extender_app
from services.advisor.fleet_feeds import start_feeds
from services.advisor.fleet_index import FleetIndex
from services.advisor.grpc_service import PlacementService
from services.advisor.metrics import AdvisorMetrics
from services.advisor.reservation_ids import ExtenderIds, shared_key
from services.advisor.reservation_reaper import ReservationReaper
from services.advisor.settings import AdvisorSettings
from services.advisor.standard_services import standard_services
from services.advisor.transport import CorkedServer

log = structlog.get_logger(__name__)

_STOP_TIMEOUT_S = 5.0
_GAUGE_PERIOD_S = 1.0


def _bound_port(server: Any) -> int:
    sockets = getattr(server, "sockets", None) or []
    return int(sockets[0].getsockname()[1]) if sockets else 0


class AdvisorService:
    def __init__(self, settings: AdvisorSettings, metrics: AdvisorMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or AdvisorMetrics()
        self.health = Health()
        self.grpc_serving = ServiceStatus()  # grpc.health.v1: SERVING once the fleet index is synced
        self.grpc_serving.set(False)
        self.store = Store(settings.etcd_config())
        self.fleet = FleetIndex(healthy_only=settings.healthy_only)
        self.advisor = Advisor(
            self.fleet,
            self.store,
            AdvisorConfig(
                default_ttl_s=settings.default_reservation_ttl_s,
                max_ttl_s=settings.max_reservation_ttl_s,
                holder=settings.holder,
                max_nodes_per_holder=settings.max_reserved_nodes_per_holder,
                max_field_bytes=settings.max_field_bytes,
            ),
            self.metrics,
        )
        self.grpc_port: int | None = None
        self.extender_port: int | None = None
        self.health_port: int | None = None
        self.started = asyncio.Event()
        self._kube_client: Any = None

    async def _template_source(self) -> TemplateDomainSource:
        if self.settings.template_source == "kubernetes":
            # Imported here: the store source needs no Kubernetes client at all.
            from kubernetes_asyncio import client, config

            from libs.kube.client import without_env_lookups

            if self.settings.kubeconfig:
                await config.load_kube_config(config_file=self.settings.kubeconfig)
            else:
                config.load_incluster_config()
            self._kube_client = await without_env_lookups(client.ApiClient())
            return CachedTemplateSource(
                KubeTemplateSource(self._kube_client, self.settings.resource_api_version)
            )
        return StoreTemplateSource(self.store)

    def _on_synced(self) -> None:
        self.health.set_ready("inventory-synced", True)
        self.grpc_serving.set(True)
        # The synced fleet index (10,000 node records and their index) hardly changes from now on.
        # Moving it out of the collector's view keeps full collections, which would otherwise walk
        # all of it, from pausing decisions for tens of milliseconds.
        gc.collect()
        gc.freeze()
        log.info("inventory frozen for the garbage collector", objects=gc.get_freeze_count())

    async def _update_gauges(self) -> None:
        while True:
            self.metrics.free_nodes.set(self.fleet.tally.free_count)
            self.metrics.inventory_nodes.set(len(self.fleet.nodes))
            self.metrics.fragmentation.set(self.fleet.tally.fragmentation())
            await asyncio.sleep(_GAUGE_PERIOD_S)

    async def run(self, stop: asyncio.Event) -> None:
        s = self.settings
        self.health.set_ready("inventory-synced", False)
        await with_retries(self.store.connect, "connect to etcd", deadline_s=60.0)
        health_runner, self.health_port = await start_health_server(
            self.health, s.health_host, s.health_port, self.metrics.registry
        )
        tasks: list[asyncio.Task[None]] = []
        grpc_servers: list[Server] = []
        extender_runner: web.AppRunner | None = None
        try:
            feeds = start_feeds(self.fleet, self.store, on_ready=self._on_synced)
            for feed in feeds:
                self.health.watch_task(feed.get_name(), feed)
            tasks.extend(feeds)
            tasks.append(asyncio.create_task(self._update_gauges(), name="gauges"))

            services = standard_services([PlacementService(self.advisor)], self.grpc_serving)
            tls = s.tls_cert_file != ""
            limits = ServerLimits(s.grpc_max_message_bytes, s.idle_timeout_s, s.max_connections)
            if s.grpc_host:
                server = CorkedServer(services, limits=limits)
                track_client_identity(server)
                await server.start(
                    s.grpc_host,
                    s.grpc_port,
                    ssl=server_tls_context(s.tls_cert_file, s.tls_key_file, s.tls_client_ca_file, http2=True)
                    if tls
                    else None,
                )
                grpc_servers.append(server)
                self.grpc_port = _bound_port(server._server)
                log.info("gRPC listening", host=s.grpc_host, port=self.grpc_port, mutual_tls=tls)
            if s.grpc_unix_socket:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(s.grpc_unix_socket)
                unix_server = CorkedServer(services, limits=limits)
                await unix_server.start(path=s.grpc_unix_socket)
                os.chmod(s.grpc_unix_socket, 0o660)
                grpc_servers.append(unix_server)
                log.info("gRPC listening", socket=s.grpc_unix_socket)

            if s.extender_enabled:
                presence = DomainPresence()
                placer = DomainPlacer(
                    self.advisor,
                    ttl_s=s.extender_reservation_ttl_s,
                    holder=f"{EXTENDER_HOLDER_PREFIX}{s.holder}",
                    presence=presence,
                    ids=ExtenderIds(await shared_key(self.store)),
                )
                # Releases the extender's reservations once bound or once their domain is gone.
                reaper = ReservationReaper(placer, presence, self.metrics)
                reaper.attach()
                for coro, name in (
                    (presence.follow(self.store), "domain-presence"),
                    (reaper.run(), "reaper"),
                ):
                    task = asyncio.create_task(coro, name=name)
                    self.health.watch_task(name, task)
                    tasks.append(task)
                extender = Extender(
                    placer,
                    await self._template_source(),
                    StoreDomainSizes(self.store, presence),
                    self.metrics,
                )
                app = build_extender_app(
                    extender,
                    s.extender_prefix,
                    s.extender_filter_verb,
                    s.extender_prioritize_verb,
                    max_body_bytes=s.extender_max_body_bytes,
                    read_timeout_s=s.idle_timeout_s,
                )
                extender_runner = CappedAppRunner(
                    app, s.max_connections, access_log=None, keepalive_timeout=s.idle_timeout_s
                )
                await extender_runner.setup()
                site = web.TCPSite(
                    extender_runner,
                    s.extender_host,
                    s.extender_port,
                    ssl_context=server_tls_context(
                        s.tls_cert_file, s.tls_key_file, s.tls_client_ca_file, http2=False
                    )
                    if tls
                    else None,
                )
                await site.start()
                self.extender_port = _bound_port(site._server)
                log.info(
                    "extender listening",
                    host=s.extender_host,
                    port=self.extender_port,
                    prefix=s.extender_prefix,
                    mutual_tls=tls,
                )

            self.started.set()
            await stop.wait()
            log.info("stopping")
        finally:
            await self._shutdown(grpc_servers, extender_runner, tasks)
            await health_runner.cleanup()

    async def _shutdown(
        self,
        grpc_servers: list[Server],
        extender_runner: web.AppRunner | None,
        tasks: list[asyncio.Task[None]],
    ) -> None:
        # Stop taking calls first; in-flight ones get a bounded grace period.
        for server in grpc_servers:
            server.close()
        for server in grpc_servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), timeout=_STOP_TIMEOUT_S)
        if extender_runner is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(extender_runner.cleanup(), timeout=_STOP_TIMEOUT_S)
        if self.settings.grpc_unix_socket:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.settings.grpc_unix_socket)
        await cancel_until_done(tasks)
        with contextlib.suppress(Exception):
            await self.advisor.close()
        if self._kube_client is not None:
            with contextlib.suppress(Exception):
                await self._kube_client.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.store.close(), timeout=_STOP_TIMEOUT_S)


async def _amain(settings: AdvisorSettings) -> None:
    await AdvisorService(settings).run(stop_on_signals())


def _log_start(settings: AdvisorSettings) -> None:
    log.info(
        "cd-placement-advisor starting",
        identity=settings.holder,
        etcd=settings.etcd_endpoint,
        prefix=settings.etcd_prefix,
        grpc=f"{settings.grpc_host}:{settings.grpc_port}" if settings.grpc_host else None,
        grpc_socket=settings.grpc_unix_socket or None,
        extender=f"{settings.extender_host}:{settings.extender_port}" if settings.extender_enabled else None,
        event_loop=settings.event_loop,
    )


def main(argv: Sequence[str] | None = None) -> None:
    run_service(
        AdvisorSettings,
        argv,
        env_prefix="CD_ADVISOR_",
        prog="cd-placement-advisor",
        description="Clique-aware placement advisor (gRPC) and kube-scheduler extender",
        name="placement advisor",
        run=_amain,
        on_start=_log_start,
        loop_factory=lambda settings: _loop_factory(settings.event_loop),
    )


def _loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when asked for or (auto) installed: it cuts the per-call cost of the gRPC server."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise SystemExit(
                "cd-placement-advisor: --event-loop uvloop, but uvloop is not installed"
            ) from None
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


if __name__ == "__main__":
    main()
