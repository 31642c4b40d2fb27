"""``cd-node-agent``: the kubelet DRA plugin of a node as one asyncio program.

The IMEX side (node record on a lease, IMEX daemons, their DaemonStatus records) is a program of
its own, ``cd-imex-agent``. The plugin holds no lease and writes nothing on its own account at
start: it reads its node record and its daemon's readiness from the store, so a restart or an
upgrade of the plugin changes nothing there.

Start order: health server -> store -> the plugin's parts (`services.nodeagent.wire.plugin`, the one
composition root, shared with tools that host many nodes) -> node view (waits until the node
record was seen) -> reconcile checkpoint / store / CDI directory -> DRA socket -> registration
socket (kubelet starts calling only then). Shutdown on SIGTERM/SIGINT in reverse: registration and DRA sockets
close first, then the background tasks (store watches) end.

A background task that fails is logged, shown on ``/healthz`` and restarted with capped
backoff; the problem clears once it has run for a while again.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from libs.hardware.errors import HardwareError
from libs.hardware.factory import open_node_hardware_from
from libs.runtime.health import Health
from libs.runtime.service import run_service, serving, stop_on_signals
from services.nodeagent.core.claim import ClaimSource
from services.nodeagent.settings import AgentSettings
from services.nodeagent.shell.metrics import AgentMetrics
from services.nodeagent.shell.store_batch import BatchedReads, StoreBatch
from services.nodeagent.wire.claim_source import KubeClaimSource, StoreClaimSource
from services.nodeagent.wire.plugin import Plugin, compose_plugin
from services.nodeagent.wire.unix_socket import SocketInUse

log = structlog.get_logger(__name__)


async def _kube_api_client(settings: AgentSettings) -> Any:
    from kubernetes_asyncio import config as kube_config
    from kubernetes_asyncio.client import ApiClient

    from libs.kube.client import without_env_lookups

    if settings.kubeconfig:
        await kube_config.load_kube_config(config_file=settings.kubeconfig)
    else:
        kube_config.load_incluster_config()
    return await without_env_lookups(ApiClient())


async def run_agent(settings: AgentSettings, stop: asyncio.Event | None = None) -> None:
    """Run until ``stop`` is set (or SIGTERM/SIGINT)."""
    stop = stop_on_signals(stop)
    node_name = settings.node_name
    health = Health()
    metrics = AgentMetrics()
    health.set_ready("serving", False)
    hardware = open_node_hardware_from(settings)
    plugin: Plugin | None = None
    try:
        async with serving(settings, health, metrics.registry, gate="serving") as service:
            try:
                claims: ClaimSource
                batch = StoreBatch(service.store)
                if settings.claim_source == "kubernetes":
                    kube_api = await _kube_api_client(settings)
                    service.close_after_tasks(kube_api.close)
                    claims = KubeClaimSource(kube_api, timeout_s=settings.kube_timeout_s)
                else:
                    kube_api = None
                    # A prepare reads its claim and its domain at once: one store transaction.
                    claims = StoreClaimSource(BatchedReads(batch))
                plugin = compose_plugin(
                    service.store, settings, hardware, claims, health, metrics, batch=batch
                )
                for name, run in plugin.tasks():
                    service.spawn(name, run)
                if kube_api is not None:
                    from services.nodeagent.wire.resourceslice import (
                        ResourceSlicePublisher,
                        ResourceSliceSettings,
                    )

                    publisher = ResourceSlicePublisher(
                        kube_api,
                        node_name,
                        ResourceSliceSettings(
                            publish_clique_label=settings.publish_clique_label,
                            delete_on_shutdown=settings.delete_resource_slice_on_exit,
                            request_timeout_s=settings.kube_timeout_s,
                        ),
                    )
                    view = plugin.node_view
                    service.spawn("resource-slice", lambda: publisher.run(view.changes()))
                if not await plugin.serve(stop):
                    return
                log.info(
                    "node agent serving",
                    node=node_name,
                    dra_socket=str(plugin.dra_socket),
                    health_port=service.health_port,
                    claim_source=settings.claim_source,
                    hardware=settings.hardware,
                )
                await stop.wait()
                log.info("shutting down", node=node_name)
            finally:
                # Sockets first (kubelet stops calling), then `serving` ends the background tasks.
                health.set_ready("serving", False)
                if plugin is not None:
                    await plugin.close()
    finally:
        hardware.close()
        log.info("node agent stopped", node=node_name)


def main(argv: list[str] | None = None) -> None:
    run_service(
        AgentSettings,
        argv,
        prog="cd-node-agent",
        description="ComputeDomain node agent (kubelet DRA plugin).",
        name="node agent",
        run=run_agent,
        fatal=(HardwareError, SocketInUse, ValueError, OSError),
    )


if __name__ == "__main__":
    main()
