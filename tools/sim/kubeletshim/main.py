"""Entry point: ``python -m tools.sim.kubeletshim`` plays the kubelet of every listed node in one process.

Each node runs in its own task; one that fails is logged and restarted with capped backoff, so a
bad node does not take the others down. SIGTERM/SIGINT stop everything (Nodes stay registered,
as they do when a kubelet stops).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import structlog
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config

from libs.kube.resource_api import ResourceApiUnavailable
from libs.runtime.backoff import Backoff
from libs.runtime.logging import configure_logging
from libs.runtime.settings import load_settings_or_exit
from tools.sim.hardware.cluster import ClusterDescription
from tools.sim.kubeletshim.node import API_ERRORS, NodeKubelet
from tools.sim.kubeletshim.nodes import NodesFileError, ShimNode, load_nodes_file, nodes_of_cluster
from tools.sim.kubeletshim.release import KubeletRelease, discover_release
from tools.sim.kubeletshim.settings import ShimSettings

log = structlog.get_logger(__name__)

# A node that ran this long before failing starts its backoff from the beginning again.
_STABLE_AFTER_S = 60.0


def shim_nodes(settings: ShimSettings) -> list[ShimNode]:
    """The nodes to play, from --nodes-file or --sim-cluster (exactly one of them)."""
    if bool(settings.nodes_file) == bool(settings.sim_cluster):
        raise NodesFileError("give exactly one of --nodes-file and --sim-cluster")
    if settings.nodes_file:
        return load_nodes_file(Path(settings.nodes_file))
    if not settings.sim_nodes_dir:
        raise NodesFileError("--sim-cluster needs --sim-nodes-dir")
    cluster = ClusterDescription.load(Path(settings.sim_cluster))
    return nodes_of_cluster(cluster, Path(settings.sim_nodes_dir))


async def api_client(settings: ShimSettings, node_count: int) -> k8s_client.ApiClient:
    configuration = k8s_client.Configuration()
    if settings.kubeconfig:
        await k8s_config.load_kube_config(config_file=settings.kubeconfig, client_configuration=configuration)
    else:
        k8s_config.load_incluster_config(client_configuration=configuration)
    # Every node keeps a watch open, and pods sync concurrently: more than the default pool.
    configuration.connection_pool_maxsize = max(100, 4 * node_count)
    return k8s_client.ApiClient(configuration)


async def _keep_node(kubelet: NodeKubelet) -> None:
    loop = asyncio.get_running_loop()
    backoff = Backoff(initial=1.0, cap=30.0)
    while True:
        started = loop.time()
        try:
            await kubelet.run()
            message = "stopped unexpectedly"
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
            log.exception("node kubelet failed; restarting", node=kubelet.node.name)
        if loop.time() - started >= _STABLE_AFTER_S:
            backoff.reset()
        delay = backoff.next_delay()
        log.warning(
            "restarting node kubelet", node=kubelet.node.name, reason=message, retry_in_s=round(delay, 2)
        )
        await asyncio.sleep(delay)


_RELEASE_ERRORS: tuple[type[BaseException], ...] = (*API_ERRORS, ResourceApiUnavailable, ValueError)


async def control_plane_release(
    api: k8s_client.ApiClient, settings: ShimSettings, stop: asyncio.Event
) -> KubeletRelease | None:
    """The control plane's release, asked until it answers (None when stopped first)."""
    backoff = Backoff(initial=settings.retry_initial_s, cap=settings.retry_cap_s)
    while not stop.is_set():
        try:
            release = await discover_release(api, settings.api_timeout_s)
            log.info(
                "control plane release",
                kubernetes=release.git_version,
                resource_api=release.resource_api,
                dra_services=list(release.dra_services),
            )
            return release
        except _RELEASE_ERRORS as exc:
            delay = backoff.next_delay()
            log.warning(
                "asking the API server its version failed; retrying", error=str(exc), retry_in_s=delay
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=delay)
    return None


async def run_shim(settings: ShimSettings, nodes: Sequence[ShimNode], stop: asyncio.Event) -> None:
    api = await api_client(settings, len(nodes))
    try:
        release = await control_plane_release(api, settings, stop)
        if release is None:
            return
        kubelets = [NodeKubelet(node, api, settings, release) for node in nodes]
        tasks = [asyncio.create_task(_keep_node(k), name=f"node-{k.node.name}") for k in kubelets]
        log.info("kubelet shim running", nodes=len(nodes), driver=settings.driver)
        try:
            await stop.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await api.close()
    log.info("kubelet shim stopped")


async def _amain(settings: ShimSettings, nodes: Sequence[ShimNode]) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await run_shim(settings, nodes, stop)


def main(argv: Sequence[str] | None = None) -> int:
    settings = load_settings_or_exit(
        ShimSettings,
        argv,
        env_prefix="KUBELET_SHIM_",
        prog="python -m tools.sim.kubeletshim",
        description="Plays kubelet for simulated nodes: Node, Lease, DRA plugin calls, pod status.",
    )
    configure_logging(settings.log_format, settings.log_level)  # type: ignore[arg-type]
    try:
        nodes = shim_nodes(settings)
    except (NodesFileError, OSError, ValueError) as exc:
        print(f"kubelet shim: {exc}", file=sys.stderr)
        return 2
    if not nodes:
        print("kubelet shim: no nodes to play", file=sys.stderr)
        return 2
    asyncio.run(_amain(settings, nodes))
    return 0
