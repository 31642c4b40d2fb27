"""``cd-node-agent``: the kubelet DRA plugin of a node as one asyncio program.

The IMEX side (node record on a lease, IMEX daemons, their DaemonStatus records) is a program of
its own, ``cd-imex-agent``. The plugin holds no lease and writes nothing on its own account at
start: it reads its node record and its daemon's readiness from the store, so a restart or an
upgrade of the plugin changes nothing there.

Start order: health server -> store -> node view (waits until the node record was seen) ->
reconcile checkpoint / store / CDI directory -> DRA socket -> registration socket (kubelet
starts calling only then). Shutdown on SIGTERM/SIGINT in reverse: registration and DRA sockets
close first, then the background tasks (store watches) end.

A background task that fails is logged, shown on ``/healthz`` and restarted with capped
backoff; the problem clears once it has run for a while again.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog

from libs.cdi.specdir import ClaimSpecDir
from libs.hardware.errors import HardwareError
from libs.hardware.factory import open_node_hardware
from libs.hardware.interface import NodeHardware
from libs.runtime.backoff import Backoff
from libs.runtime.health import Health, start_health_server
from libs.runtime.logging import configure_logging
from libs.runtime.settings import load_settings_or_exit
from libs.state.store import Store, with_retries
from services.nodeagent.checkpoint import Checkpoint, checkpoint_path
from services.nodeagent.claimsource import ClaimSource, KubeClaimSource, StoreClaimSource
from services.nodeagent.daemonview import DaemonView
from services.nodeagent.driver import ClaimDispatcher, DraServer, dra_socket_path
from services.nodeagent.metrics import AgentMetrics
from services.nodeagent.nodeview import NodeView
from services.nodeagent.registration import RegistrationServer, RegistrationService, registration_socket_path
from services.nodeagent.settings import AgentSettings
from services.nodeagent.state import STORE_FAILURES, DeviceState
from services.nodeagent.unixsocket import SocketInUse

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
        # A restarted task that runs long enough again clears its problem.
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


def _open_hardware(settings: AgentSettings) -> NodeHardware:
    return open_node_hardware(
        settings.hardware,
        sim_cluster=Path(settings.sim_cluster) if settings.sim_cluster else None,
        node=settings.node_name,
        sim_state_base=Path(settings.sim_state_dir) if settings.sim_state_dir else None,
        proc_devices=Path(settings.proc_devices),
        dev_root=Path(settings.driver_root),
    )


async def _kube_api_client(settings: AgentSettings) -> Any:
    from kubernetes_asyncio import config as kube_config
    from kubernetes_asyncio.client import ApiClient

    if settings.kubeconfig:
        await kube_config.load_kube_config(config_file=settings.kubeconfig)
    else:
        kube_config.load_incluster_config()
    return ApiClient()


async def run_agent(settings: AgentSettings, stop: asyncio.Event | None = None) -> None:
    """Run until ``stop`` is set (or SIGTERM/SIGINT)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    node_name = settings.node_name
    health = Health()
    metrics = AgentMetrics()
    health.set_ready("serving", False)
    hardware = _open_hardware(settings)
    health_runner, health_port = await start_health_server(
        health, settings.health_host, settings.health_port, metrics.registry
    )
    store = Store(settings.etcd_config())
    try:
        # etcd may still be starting (or restarting) when the agent comes up: retry, do not exit.
        await with_retries(store.connect, what="connect to etcd", deadline_s=settings.etcd_timeout_s * 12)
    except BaseException:
        await health_runner.cleanup()
        hardware.close()
        raise
    kube_api: Any = None
    background: list[asyncio.Task[None]] = []
    dra: DraServer | None = None
    registration: RegistrationServer | None = None

    def spawn(name: str, run: Callable[[], Awaitable[object]]) -> None:
        background.append(asyncio.create_task(keep_running(name, run, health), name=name))

    try:
        node_view = NodeView(store, node_name)
        daemons = DaemonView(store, node_name, metrics)
        spawn("node-view", node_view.run)
        spawn("daemon-view", daemons.run)
        claims: ClaimSource
        if settings.claim_source == "kubernetes":
            from services.nodeagent.resourceslice import ResourceSlicePublisher, ResourceSliceSettings

            kube_api = await _kube_api_client(settings)
            claims = KubeClaimSource(kube_api, timeout_s=settings.kube_timeout_s)
            publisher = ResourceSlicePublisher(
                kube_api,
                node_name,
                ResourceSliceSettings(
                    publish_clique_label=settings.publish_clique_label,
                    delete_on_shutdown=settings.delete_resource_slice_on_exit,
                    request_timeout_s=settings.kube_timeout_s,
                ),
            )
            spawn("resource-slice", lambda: publisher.run(node_view.changes()))
        else:
            claims = StoreClaimSource(store)

        # Serve kubelet only once the node record was seen (joins need its address and clique).
        if not await _until_registered(node_view, stop, settings.register_timeout_s):
            return

        kubelet_dir = settings.kubelet_path
        state = DeviceState(
            store=store,
            identity=node_view,
            claims=claims,
            daemons=daemons,
            hardware=hardware,
            checkpoint=Checkpoint.load(
                checkpoint_path(kubelet_dir),
                Path(settings.boot_id_file),
                tombstone_ttl_s=settings.tombstone_ttl_s,
            ),
            cdi=ClaimSpecDir(Path(settings.cdi_root), host_dev_root=str(_host_dev_root(hardware))),
            metrics=metrics,
            prepare_budget_s=settings.prepare_budget_s,
            checkpoint_fsync=settings.checkpoint_fsync,
        )
        _prewarm(state, hardware)
        backoff = Backoff(initial=0.2, cap=5.0)
        while not stop.is_set():
            try:
                await state.reconcile()
                break
            except STORE_FAILURES as exc:
                delay = backoff.next_delay()
                log.warning(
                    "reconcile failed; retrying", error=str(exc) or type(exc).__name__, retry_in_s=delay
                )
                await asyncio.sleep(delay)
        # Follow the held domain's daemon from the start (its restart count is a metric).
        daemons.follow(state.held_domain())

        dra = DraServer(ClaimDispatcher(state, metrics), dra_socket_path(kubelet_dir))
        await dra.start()
        registration = RegistrationServer(
            RegistrationService(dra.socket_path, health), registration_socket_path(kubelet_dir)
        )
        await registration.start()
        health.set_ready("serving", True)
        log.info(
            "node agent serving",
            node=node_name,
            dra_socket=str(dra.socket_path),
            health_port=health_port,
            claim_source=settings.claim_source,
            hardware=settings.hardware,
        )
        await stop.wait()
        log.info("shutting down", node=node_name)
    finally:
        health.set_ready("serving", False)
        if registration is not None:
            await registration.stop()
        if dra is not None:
            await dra.stop()
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        if kube_api is not None:
            await kube_api.close()
        await health_runner.cleanup()
        await store.close()
        hardware.close()
        log.info("node agent stopped", node=node_name)


async def _until_registered(view: NodeView, stop: asyncio.Event, warn_after_s: float) -> bool:
    """Wait until the node record was seen in the store; False if asked to stop first."""
    stopping = asyncio.create_task(stop.wait())
    try:
        while True:
            registered = asyncio.create_task(view.wait_registered(warn_after_s))
            await asyncio.wait({registered, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if stopping.done():
                registered.cancel()
                return False
            try:
                registered.result()
                return True
            except TimeoutError:
                log.warning(
                    "node record not in the store yet (is cd-imex-agent running on this node?); waiting",
                    node=view.node_name,
                )
    finally:
        stopping.cancel()


def _host_dev_root(hardware: NodeHardware) -> Path:
    """The host directory that plays ``/dev`` for channel device nodes."""
    return hardware.imex_channel_path(0).parent.parent


def _prewarm(state: DeviceState, hardware: NodeHardware) -> None:
    """Pay the one-off costs (channel major, All-mode spec array) before kubelet calls."""
    try:
        state.cdi.prewarm(hardware.imex_channel_major())
    except HardwareError as exc:
        log.info("IMEX channels not available (non-fabric node?)", error=str(exc))


def main(argv: list[str] | None = None) -> None:
    settings = load_settings_or_exit(
        AgentSettings,
        argv,
        prog="cd-node-agent",
        description="ComputeDomain node agent (kubelet DRA plugin).",
    )
    configure_logging(settings.log_format, settings.log_level)  # type: ignore[arg-type]
    try:
        asyncio.run(run_agent(settings))
    except (HardwareError, SocketInUse, ValueError, OSError) as exc:
        log.error("node agent cannot run", error=str(exc))
        sys.exit(1)


if __name__ == "__main__":
    main()
