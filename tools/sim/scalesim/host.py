"""Many simulated nodes in one asyncio process, sharing a small pool of etcd clients.

A node runs two programs (``cd-imex-agent`` and ``cd-node-agent``); each process costs ~60 MB and
most of a second of CPU to start; 512 of them do not fit a 2-core machine, and 20,000 do not fit
any. `ScaleHost` runs each node as a `SimAgent` (both programs, built by their own composition
roots) on one event loop instead: each node keeps its own sockets, kubelet/CDI/IMEX directories,
checkpoint and simulated IMEX daemon process, and talks to etcd through one of ``store_pool``
shared `Store` objects (nodes are spread over them round-robin; each store is one gRPC channel
and one watch stream).
"""

from __future__ import annotations

import asyncio
import os
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog
from kubernetes_asyncio.client import ApiClient, Configuration
from kubernetes_asyncio.config import load_kube_config

from libs.kube.client import without_env_lookups
from libs.state.config import EtcdConfig
from libs.state.store import Store
from services.nodeagent.wire.unix_socket import MAX_SOCKET_PATH
from tools.cdsim import proc_scan
from tools.sim.hardware.cluster import ClusterDescription
from tools.sim.scalesim.agent import AgentLayout, AgentOptions, KubeMode, SimAgent
from tools.sim.scalesim.poll_feed import PrefixPoller
from tools.sim.scalesim.watch_hub import WatchHub

log = structlog.get_logger(__name__)


def spread_nodes(cluster: ClusterDescription, count: int, racks: int | None = None) -> list[str]:
    """``count`` nodes over the first ``racks`` racks (default: all), as evenly as possible and
    contiguous from tray 0 within each rack (a clique-aware scheduler fills racks like that)."""
    racks = cluster.racks if racks is None else racks
    if not 1 <= racks <= cluster.racks:
        raise ValueError(f"racks must be in [1, {cluster.racks}], got {racks}")
    if not 0 <= count <= racks * cluster.trays_per_rack:
        raise ValueError(f"{count} nodes do not fit in {racks} racks of {cluster.trays_per_rack} trays")
    base, extra = divmod(count, racks)
    nodes: list[str] = []
    for rack in range(racks):
        for tray in range(base + (1 if rack < extra else 0)):
            nodes.append(cluster.node_name(rack, tray))
    return nodes


def rss_mb(pid: int | None = None) -> float:
    """Resident set size of a process (default: this one), MiB; 0.0 if it is gone."""
    try:
        status = Path(f"/proc/{pid or os.getpid()}/status").read_text()
    except OSError:
        return 0.0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@dataclass
class HostReport:
    """What a started host looks like (written to the ready file by the CLI)."""

    nodes: dict[str, str]  # node -> DRA socket ("" for inventory-only agents)
    inventory_only: bool
    store_pool: int
    start_s: float
    rss_mb: float
    peak_rss_mb: float
    problems: dict[str, dict[str, str]] = field(default_factory=dict)
    # Longest delay of the event loop seen so far (every hosted agent waits that long).
    max_loop_lag_s: float = 0.0
    # Node leases that expired under a running agent (each made its node look lost for a while).
    lease_losses: int = 0
    lease_ttl_s: int = 0

    def to_json(self) -> dict[str, object]:
        return {
            "nodes": self.nodes,
            "inventory_only": self.inventory_only,
            "store_pool": self.store_pool,
            "start_s": round(self.start_s, 3),
            "rss_mb": round(self.rss_mb, 1),
            "peak_rss_mb": round(self.peak_rss_mb, 1),
            "problems": self.problems,
            "max_loop_lag_s": round(self.max_loop_lag_s, 3),
            "lease_losses": self.lease_losses,
            "lease_ttl_s": self.lease_ttl_s,
        }


class LoopLag:
    """Measures how late the event loop runs a 100 ms timer: the delay every hosted agent sees."""

    def __init__(self, interval_s: float = 0.1, warn_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.warn_s = warn_s
        self.max_s = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="scalesim-loop-lag")

    def reset(self) -> float:
        """The maximum so far, then start over."""
        seen, self.max_s = self.max_s, 0.0
        return seen

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(self.interval_s)
            lag = loop.time() - before - self.interval_s
            if lag > self.max_s:
                self.max_s = lag
            if lag > self.warn_s:
                log.warning("event loop lagging", lag_s=round(lag, 3))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None


# What the hosted nodes' API requests say they are (the audit log tells them from the kubelet's).
KUBE_USER_AGENT = "cd-node-agent/scalesim"


async def kube_client(kubeconfig: str, nodes: int) -> ApiClient:
    """One API client for the hosted nodes: a connection for each node's ResourceSlice watch (held
    open; services/nodeagent/wire/resourceslice.py), and one each for a share of them at once besides."""
    configuration = Configuration()
    await load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    # Without a connection per watch, the watches take the whole pool and every other request of
    # the host waits for one until it times out (18 nodes on 16 connections published no slice).
    configuration.connection_pool_maxsize = nodes + max(16, min(128, nodes // 2))
    # As the node agent's own client (services/nodeagent/main.py).
    api = await without_env_lookups(ApiClient(configuration))
    api.user_agent = KUBE_USER_AGENT
    return api


class ScaleHost:
    """Start, hold and stop a set of simulated node agents."""

    def __init__(
        self,
        cluster: ClusterDescription,
        nodes: Sequence[str],
        state_dir: Path,
        etcd: EtcdConfig,
        options: AgentOptions,
        store_pool: int = 4,
        share_watches: bool = True,
        directory_poll_s: float = 0.1,
        kubeconfig: str = "",
        kube_timeout_s: float = 10.0,
    ) -> None:
        if store_pool < 1:
            raise ValueError(f"store_pool must be >= 1, got {store_pool}")
        if len(set(nodes)) != len(nodes):
            raise ValueError("node names must be unique")
        self.cluster = cluster
        self.node_names = list(nodes)
        self.state_dir = state_dir
        self.etcd = etcd
        self.options = options
        longest = max(
            (self.layout(n).registration_socket for n in self.node_names),
            key=lambda p: len(str(p)),
            default=None,
        )
        if longest is not None and len(os.fsencode(longest)) > MAX_SOCKET_PATH:
            raise ValueError(
                f"state dir {state_dir} is too deep: socket path {longest} exceeds {MAX_SOCKET_PATH} bytes"
            )
        self.stores = [Store(etcd) for _ in range(min(store_pool, max(1, len(nodes))))]
        self.agents: dict[str, SimAgent] = {}
        self.start_s = 0.0
        # The shared directory feeds (a domain's members) are read every `directory_poll_s` on a
        # client of their own (tools/sim/scalesim/watch_hub.py says why).
        self.feed_store = Store(etcd) if share_watches else None
        self.hub = (
            WatchHub(directory_watch=PrefixPoller(directory_poll_s), directory_store=self.feed_store)
            if share_watches
            else None
        )
        self.lag = LoopLag()
        self._sockets: dict[str, str] = {}
        # Kubernetes mode: claims from the API server, a ResourceSlice per node (see SimAgent).
        self.kubeconfig = kubeconfig
        self.kube_timeout_s = kube_timeout_s
        self.kube: KubeMode | None = None

    def _clients(self) -> list[Store]:
        return [*self.stores, *([self.feed_store] if self.feed_store is not None else [])]

    def layout(self, node: str) -> AgentLayout:
        return AgentLayout(self.state_dir / node)

    async def start(self, timeout_s: float = 300.0, batch: int = 32) -> HostReport:
        """Start every agent and wait until all serve (inventory-only: are registered).

        Agents start `batch` at a time, each batch once the previous one serves: nodes of a
        cluster do not all boot in the same millisecond, and on one event loop a few hundred
        agents starting at once would queue every lease refresh behind all their start-up work
        (long enough for early leases to expire before their first refresh).
        """
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        began = time.monotonic()
        self.lag.start()
        await asyncio.gather(*(s.connect() for s in self._clients()))
        if self.kubeconfig and self.kube is None:
            self.kube = KubeMode(
                await kube_client(self.kubeconfig, len(self.node_names)), self.kube_timeout_s
            )
        try:
            async with asyncio.timeout(timeout_s):
                for first in range(0, len(self.node_names), batch):
                    started = []
                    for i in range(first, min(first + batch, len(self.node_names))):
                        node = self.node_names[i]
                        agent = SimAgent(
                            self.cluster,
                            node,
                            self.layout(node),
                            self.stores[i % len(self.stores)],
                            self.options,
                            **({"watch": self.hub.watch} if self.hub is not None else {}),
                            kube=self.kube,
                        )
                        self.agents[node] = agent
                        agent.start()
                        started.append(agent)
                    for agent in started:
                        await agent.wait_serving()
        except TimeoutError:
            waiting = [n for n, a in self.agents.items() if not a.serving.is_set()]
            raise TimeoutError(
                f"{len(waiting)} of {len(self.agents)} agents not serving after {timeout_s:.0f}s "
                f"(first: {', '.join(waiting[:5])})"
            ) from None
        self.start_s = time.monotonic() - began
        log.info("scale host serving", nodes=len(self.agents), start_s=round(self.start_s, 2))
        return self.report()

    def report(self) -> HostReport:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        if len(self._sockets) != len(self.agents):
            self._sockets = {
                n: "" if self.options.inventory_only else str(a.layout.dra_socket)
                for n, a in self.agents.items()
            }
        return HostReport(
            nodes=self._sockets,
            inventory_only=self.options.inventory_only,
            store_pool=len(self.stores),
            start_s=self.start_s,
            rss_mb=rss_mb(),
            peak_rss_mb=peak,
            problems={n: dict(a.health.problems) for n, a in self.agents.items() if a.health.problems},
            max_loop_lag_s=self.lag.max_s,
            lease_losses=sum(a.inventory.lease.losses for a in self.agents.values()),
            lease_ttl_s=self.options.lease_ttl_s,
        )

    async def stop(self) -> int:
        """Stop every agent (their daemons with them), then close the store clients.

        Returns how many IMEX daemons were still running under the state directory afterwards
        and had to be killed (a supervisor stopped while it was itself stopping a daemon can
        lose track of it; the host then plays the machine going down)."""
        await asyncio.gather(*(a.stop() for a in self.agents.values()))
        leftovers = proc_scan.kill_all(proc_scan.imex_daemons_under(self.state_dir))
        if leftovers:
            log.warning(
                "IMEX daemons outlived their agents; killed", count=len(leftovers), pids=leftovers[:10]
            )
        if self.hub is not None:
            await self.hub.close()
        await self.lag.stop()
        if self.kube is not None:
            await self.kube.api.close()
        await asyncio.gather(*(s.close() for s in self._clients()), return_exceptions=True)
        return len(leftovers)
