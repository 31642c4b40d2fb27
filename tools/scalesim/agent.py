"""One simulated node agent built from the real node-agent components, for hosting many in a process.

`SimAgent` wires the same parts as ``services.nodeagent.main.run_agent`` in the same order:
node inventory on a kept lease and the IMEX supervisor (both restarted on failure by the agent's
own ``keep_running``) -> wait until the node record is in the store -> checkpoint / store / CDI
reconcile -> membership keeper -> DRA socket -> registration socket. Prepare and unprepare are the
agent's own ``DeviceState`` behind its own ``DraServer``; the IMEX supervisor starts a real
simulated daemon process per domain. Nothing on the claim path is special-cased.

What differs from a node-agent process, and why:

* the ``Store`` is handed in, so many agents can share a few etcd client connections (one gRPC
  channel and one watch stream per store instead of one per node), and so is the supervisor's
  store watch (`tools.scalesim.watchhub`: one watch per prefix for all hosted agents);
* no health HTTP server and no signal handlers (the host process owns both); problems still go
  to a ``Health`` object per agent, which the host reports;
* no daemon-restart metrics exporter (a periodic metrics-only store read of the real agent);
* an *inventory-only* agent runs just the node inventory (record on a lease, hardware health
  following): the form used to hold 10,000-node inventories, clearly not able to prepare.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from libs.cdi.specdir import ClaimSpecDir
from libs.hardware.cluster import ClusterDescription
from libs.hardware.errors import HardwareError
from libs.hardware.simulated import SimulatedNodeHardware, SimulatedNodePaths, prepare_node_dirs
from libs.runtime.backoff import Backoff
from libs.runtime.health import Health
from libs.state.store import Store
from libs.state.watch import watch_prefix
from services.imexagent.inventory import InventorySettings, NodeInventory
from services.imexagent.settings import ImexSettings
from services.imexagent.supervisor import ImexSupervisor, PrefixWatcher
from services.nodeagent.checkpoint import Checkpoint, checkpoint_path
from services.nodeagent.claimsource import StoreClaimSource
from services.nodeagent.driver import ClaimDispatcher, DraServer, dra_socket_path
from services.nodeagent.main import keep_running
from services.nodeagent.metrics import AgentMetrics
from services.nodeagent.registration import RegistrationServer, RegistrationService, registration_socket_path
from services.nodeagent.state import STORE_FAILURES, DeviceState

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
    """The node-agent settings a hosted agent uses (defaults as the agent's, unless said)."""

    # Inventory only: node record on a lease, no DRA, no IMEX supervisor, no daemons.
    inventory_only: bool = False
    lease_ttl_s: int = 5
    # Simulated hardware fault-file poll; the agent polls every 0.25 s, which for thousands of
    # hosted nodes would be thousands of file reads a second for no fault ever injected.
    health_poll_interval_s: float = 0.25
    prepare_budget_s: float = 45.0
    tombstone_ttl_s: float = 300.0
    membership_check_interval_s: float = 10.0
    boot_id_file: Path = Path("/proc/sys/kernel/random/boot_id")
    imex: ImexSettings = field(default_factory=lambda: ImexSettings(stop_daemons_on_exit=True))


class SimAgent:
    """One node's agent, started with :meth:`start` and ended with :meth:`stop`."""

    def __init__(
        self,
        cluster: ClusterDescription,
        node_name: str,
        layout: AgentLayout,
        store: Store,
        options: AgentOptions,
        watch: PrefixWatcher = watch_prefix,
    ) -> None:
        self.node_name = node_name
        self._watch = watch
        self.layout = layout
        self.store = store
        self.options = options
        self.health = Health()
        # Prometheus registries are not small; an inventory-only agent has nothing to count.
        self.metrics = AgentMetrics() if not options.inventory_only else None
        self.serving = asyncio.Event()
        state_dir = (
            SimulatedNodePaths.under(layout.hardware_base, node_name).state_dir
            if options.inventory_only  # no IMEX channels: /proc/devices and /dev are not read
            else prepare_node_dirs(cluster, node_name, layout.hardware_base).state_dir
        )
        self.hardware = SimulatedNodeHardware(
            cluster, node_name, state_dir, poll_interval=options.health_poll_interval_s
        )
        self.inventory = NodeInventory(
            store,
            node_name,
            self.hardware,
            InventorySettings(
                lease_ttl_s=options.lease_ttl_s,
                kubelet_dir=str(layout.kubelet_dir),
                cdi_root=str(layout.cdi_root),
                health_poll_interval_s=options.health_poll_interval_s,
            ),
        )
        self.supervisor: ImexSupervisor | None = None
        self.state: DeviceState | None = None
        self._dra: DraServer | None = None
        self._registration: RegistrationServer | None = None
        self._background: list[asyncio.Task[None]] = []
        self._main: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self._main = asyncio.create_task(self._run(), name=f"scalesim-agent-{self.node_name}")

    async def stop(self) -> None:
        """Close the sockets, end the background tasks (the supervisor stops its daemons)."""
        self._stop.set()
        if self._main is not None:
            await asyncio.wait([self._main])
            if not self._main.cancelled() and self._main.exception() is not None:
                log.error("hosted agent failed", node=self.node_name, error=str(self._main.exception()))

    async def wait_serving(self) -> None:
        """Return once the agent serves (inventory-only: is registered); RuntimeError if it ended first."""
        assert self._main is not None, "start() first"
        serving = asyncio.create_task(self.serving.wait())
        try:
            await asyncio.wait({serving, self._main}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            serving.cancel()
        if not self.serving.is_set():
            error = None if self._main.cancelled() else self._main.exception()
            raise RuntimeError(f"agent {self.node_name} ended before serving: {error!r}")

    def _spawn(self, name: str, run: Callable[[], Awaitable[object]]) -> None:
        task = asyncio.create_task(keep_running(name, run, self.health), name=f"{name}-{self.node_name}")
        self._background.append(task)

    async def _run(self) -> None:
        try:
            self._spawn("inventory", self.inventory.run)
            if self.options.inventory_only:
                if await self._until_registered():
                    self.serving.set()
                await self._stop.wait()
                return
            await self._run_full()
        finally:
            self.health.set_ready("serving", False)
            if self._registration is not None:
                await self._registration.stop()
            if self._dra is not None:
                await self._dra.stop()
            for task in self._background:
                task.cancel()
            await asyncio.gather(*self._background, return_exceptions=True)
            self.hardware.close()

    async def _run_full(self) -> None:
        options, layout = self.options, self.layout
        self.supervisor = ImexSupervisor(
            self.store, self.node_name, self.hardware, layout.imex_work_dir, options.imex, watch=self._watch
        )
        self._spawn("imex-supervisor", self.supervisor.run)
        if not await self._until_registered():
            return
        metrics = self.metrics or AgentMetrics()
        self.state = DeviceState(
            store=self.store,
            identity=self.inventory,
            claims=StoreClaimSource(self.store),
            daemons=self.supervisor,
            hardware=self.hardware,
            checkpoint=Checkpoint.load(
                checkpoint_path(layout.kubelet_dir),
                options.boot_id_file,
                tombstone_ttl_s=options.tombstone_ttl_s,
            ),
            cdi=ClaimSpecDir(layout.cdi_root, host_dev_root=str(self.hardware.dev_root)),
            metrics=metrics,
            prepare_budget_s=options.prepare_budget_s,
        )
        with contextlib.suppress(HardwareError):
            self.state.cdi.prewarm(self.hardware.imex_channel_major())
        backoff = Backoff(initial=0.2, cap=5.0)
        while not self._stop.is_set():
            try:
                await self.state.reconcile()
                break
            except STORE_FAILURES as exc:
                delay = backoff.next_delay()
                log.warning(
                    "reconcile failed; retrying", node=self.node_name, error=str(exc), retry_in_s=delay
                )
                await asyncio.sleep(delay)
        state = self.state
        self._spawn("memberships", lambda: state.keep_memberships(options.membership_check_interval_s))
        self._dra = DraServer(ClaimDispatcher(state, metrics), layout.dra_socket)
        await self._dra.start()
        self._registration = RegistrationServer(
            RegistrationService(layout.dra_socket, self.health), layout.registration_socket
        )
        await self._registration.start()
        self.health.set_ready("serving", True)
        self.serving.set()
        await self._stop.wait()

    async def _until_registered(self) -> bool:
        """Wait for the node record in the store; False if asked to stop first."""
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
