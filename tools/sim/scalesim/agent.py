"""One simulated node, both of its programs built by their own composition roots, for hosting
many nodes in one process.

Per hosted node, `SimAgent` runs what a node runs as two processes:

* the IMEX agent (``cd-imex-agent``) as ``services.imexagent.main.compose_imex_agent`` builds it:
  the node record on a kept lease and the IMEX supervisor, which starts a real simulated IMEX
  daemon process per domain and writes its ``DaemonStatus`` records;
* the kubelet plugin (``cd-node-agent``) as ``services.nodeagent.wire.plugin.compose_plugin`` builds
  it: node record and daemon record views fed by store watches, ``DeviceState`` behind its own
  ``DraServer`` socket, then the registration socket, served only once the node record was seen.
  A prepare waits for the daemon's READY in the store, as the process does; nothing on the claim
  path is special-cased and nothing is wired here that the processes wire differently.

What differs from the two processes, and why:

* both programs of every hosted node share one event loop, and the ``Store`` is handed in, so
  many nodes share a few etcd client connections (one gRPC channel and one watch stream per
  store instead of two per node), and so is the store watch function of both programs
  (`tools.sim.scalesim.watch_hub`: one watch per prefix for all hosted nodes);
* the two programs of a node share one simulated hardware handle (the processes open the same
  node's files twice; the plugin only reads the channel major and creates channel files) and one
  ``Health`` object (their task names differ), which the host reports;
* no health HTTP servers, no signal handlers (the host process owns both), no metrics endpoint
  (the plugin's metrics are counted but not served; the IMEX agent's scrape-time daemon gauges
  are not registered);
* claims come from the store (``claim_source=store``, as in every simulation), unless the host
  runs in Kubernetes mode (`KubeMode`): then, as ``cd-node-agent --claim-source kubernetes
  --publish-clique-label true`` does, each node reads its claims from the API server and keeps
  its ResourceSlice and clique label there, through one API client the host's nodes share;
* the IMEX agent stops its daemons when the host stops it (``stop_daemons_on_exit``; the process
  default leaves them running for its next incarnation);
* an *inventory-only* node runs just the IMEX agent's node inventory (record on a lease,
  hardware health following): the form used to hold 10,000-node inventories, clearly not able
  to prepare.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import structlog
from kubernetes_asyncio.client import ApiClient

from libs.runtime.health import Health
from libs.runtime.tasks import keep_running
from libs.state.store import Store
from libs.state.watch import PrefixWatcher, watch_prefix
from services.imexagent.daemon_supervisor import ImexSupervisor
from services.imexagent.main import ImexAgent, compose_imex_agent
from services.imexagent.node_record_keeper import NodeRecordKeeper, RecordKeeperSettings
from services.imexagent.settings import ImexSettings
from services.nodeagent.core.claim import ClaimSource
from services.nodeagent.settings import AgentSettings
from services.nodeagent.shell.metrics import AgentMetrics
from services.nodeagent.shell.state import DeviceState
from services.nodeagent.wire.claim_source import KubeClaimSource, StoreClaimSource
from services.nodeagent.wire.driver import dra_socket_path
from services.nodeagent.wire.plugin import Plugin, compose_plugin
from services.nodeagent.wire.registration import registration_socket_path
from services.nodeagent.wire.resourceslice import ResourceSlicePublisher, ResourceSliceSettings
from tools.sim.hardware.cluster import ClusterDescription
from tools.sim.hardware.simulated import SimulatedNodeHardware, SimulatedNodePaths, prepare_node_dirs

log = structlog.get_logger(__name__)

_REGISTER_WARN_S = 30.0


@dataclass(frozen=True)
class AgentLayout:
    """Where one simulated node keeps its files (all under the node's own directory)."""

    root: Path

    @property
    def hardware_base(self) -> Path:
        """Base of the simulated hardware state dirs (``<base>/<node>/proc/devices``, ``dev``)."""
        return self.root / "hw"

    @property
    def kubelet_dir(self) -> Path:
        return self.root / "k"  # short: socket paths below it must fit in 107 bytes

    @property
    def cdi_root(self) -> Path:
        return self.root / "cdi"

    @property
    def imex_work_dir(self) -> Path:
        return self.root / "imex"

    @property
    def dra_socket(self) -> Path:
        return dra_socket_path(self.kubelet_dir)

    @property
    def registration_socket(self) -> Path:
        return registration_socket_path(self.kubelet_dir)


@dataclass(frozen=True)
class AgentOptions:
    """The settings a hosted node's two programs use (defaults as the programs', unless said)."""

    # Inventory only: node record on a lease, no DRA, no IMEX supervisor, no daemons.
    inventory_only: bool = False
    lease_ttl_s: int = 5
    # Simulated hardware fault-file poll; the agent polls every 0.25 s, which for thousands of
    # hosted nodes would be thousands of file reads a second for no fault ever injected.
    health_poll_interval_s: float = 0.25
    prepare_budget_s: float = 45.0
    tombstone_ttl_s: float = 300.0
    boot_id_file: Path = Path("/proc/sys/kernel/random/boot_id")
    imex: ImexSettings = field(default_factory=lambda: ImexSettings(stop_daemons_on_exit=True))


@dataclass(frozen=True)
class KubeMode:
    """Kubernetes mode of the hosted nodes: the API client they share (the host owns it)."""

    api: ApiClient
    # Deadline of each API request (cd-node-agent's --kube-timeout-s).
    timeout_s: float = 10.0


class SimAgent:
    """One node's IMEX agent and kubelet plugin, started with :meth:`start`, ended with :meth:`stop`."""

    def __init__(
        self,
        cluster: ClusterDescription,
        node_name: str,
        layout: AgentLayout,
        store: Store,
        options: AgentOptions,
        watch: PrefixWatcher = watch_prefix,
        kube: KubeMode | None = None,
    ) -> None:
        if kube is not None and options.inventory_only:
            raise ValueError("an inventory-only node has no plugin to run in Kubernetes mode")
        self.node_name = node_name
        self.layout = layout
        self.store = store
        self.options = options
        self.health = Health()
        self.serving = asyncio.Event()
        state_dir = (
            SimulatedNodePaths.under(layout.hardware_base, node_name).state_dir
            if options.inventory_only  # no IMEX channels: /proc/devices and /dev are not read
            else prepare_node_dirs(cluster, node_name, layout.hardware_base).state_dir
        )
        self.hardware = SimulatedNodeHardware(
            cluster, node_name, state_dir, poll_interval=options.health_poll_interval_s
        )
        self.imex: ImexAgent = compose_imex_agent(
            store,
            node_name,
            self.hardware,
            layout.imex_work_dir,
            options.imex,
            RecordKeeperSettings(
                lease_ttl_s=options.lease_ttl_s,
                kubelet_dir=str(layout.kubelet_dir),
                cdi_root=str(layout.cdi_root),
                health_poll_interval_s=options.health_poll_interval_s,
            ),
            watch=watch,
        )
        # Prometheus registries are not small; an inventory-only node has no plugin to count for.
        self.plugin: Plugin | None = (
            None
            if options.inventory_only
            else compose_plugin(
                store,
                AgentSettings(
                    node_name=node_name,
                    kubelet_dir=str(layout.kubelet_dir),
                    cdi_root=str(layout.cdi_root),
                    hardware="simulated",
                    prepare_budget_s=options.prepare_budget_s,
                    tombstone_ttl_s=options.tombstone_ttl_s,
                    boot_id_file=str(options.boot_id_file),
                    register_timeout_s=_REGISTER_WARN_S,
                ),
                self.hardware,
                self._claim_source(store, kube),
                self.health,
                AgentMetrics(),
                watch=watch,
            )
        )
        self.slices: ResourceSlicePublisher | None = (
            None
            if kube is None
            else ResourceSlicePublisher(
                kube.api,
                node_name,
                ResourceSliceSettings(publish_clique_label=True, request_timeout_s=kube.timeout_s),
            )
        )
        self._background: list[asyncio.Task[None]] = []
        self._main: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    @staticmethod
    def _claim_source(store: Store, kube: KubeMode | None) -> ClaimSource:
        return (
            StoreClaimSource(store) if kube is None else KubeClaimSource(kube.api, timeout_s=kube.timeout_s)
        )

    @property
    def inventory(self) -> NodeRecordKeeper:
        return self.imex.record_keeper

    @property
    def supervisor(self) -> ImexSupervisor | None:
        return None if self.options.inventory_only else self.imex.supervisor

    @property
    def state(self) -> DeviceState | None:
        return None if self.plugin is None else self.plugin.state

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self._main = asyncio.create_task(self._run(), name=f"scalesim-agent-{self.node_name}")

    async def stop(self) -> None:
        """Close the plugin's sockets, end both programs' tasks (the supervisor stops its daemons)."""
        self._stop.set()
        if self._main is not None:
            await asyncio.wait([self._main])
            if not self._main.cancelled() and self._main.exception() is not None:
                log.error("hosted agent failed", node=self.node_name, error=str(self._main.exception()))

    async def wait_serving(self) -> None:
        """Return once the plugin serves (inventory-only: the node is registered); RuntimeError
        if the node's programs ended first."""
        assert self._main is not None, "start() first"
        serving = asyncio.create_task(self.serving.wait())
        try:
            await asyncio.wait({serving, self._main}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            serving.cancel()
        if not self.serving.is_set():
            error = None if self._main.cancelled() else self._main.exception()
            raise RuntimeError(f"agent {self.node_name} ended before serving: {error!r}")

    async def _run(self) -> None:
        imex_tasks: list[asyncio.Task[None]] = []
        plugin_tasks: list[asyncio.Task[None]] = []
        try:
            for name, run in self.imex.tasks():
                if self.options.inventory_only and name != "inventory":
                    continue
                imex_tasks.append(
                    asyncio.create_task(keep_running(name, run, self.health), name=f"{name}-{self.node_name}")
                )
            if self.plugin is None:
                if await self._until_registered():
                    self.serving.set()
                await self._stop.wait()
                return
            programs = self.plugin.tasks()
            if self.slices is not None:
                slices, view = self.slices, self.plugin.node_view
                programs.append(("resource-slice", lambda: slices.run(view.changes())))
            for name, run in programs:
                plugin_tasks.append(
                    asyncio.create_task(keep_running(name, run, self.health), name=f"{name}-{self.node_name}")
                )
            if await self.plugin.serve(self._stop):
                self.serving.set()
            await self._stop.wait()
        finally:
            # The plugin first (sockets, then its watches), then the IMEX agent (its daemons).
            if self.plugin is not None:
                await self.plugin.close()
            for tasks in (plugin_tasks, imex_tasks):
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            self.hardware.close()

    async def _until_registered(self) -> bool:
        """Wait for the node record in the store (inventory-only nodes); False if asked to stop first."""
        stopping = asyncio.create_task(self._stop.wait())
        try:
            while True:
                registered = asyncio.create_task(self.inventory.wait_registered(_REGISTER_WARN_S))
                await asyncio.wait({registered, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if stopping.done():
                    registered.cancel()
                    return False
                if registered.exception() is None:
                    return True
                log.warning("node not registered in the store yet; waiting", node=self.node_name)
        finally:
            stopping.cancel()
