"""The kubelet plugin's parts on a given store, hardware and claim source: its composition root.

``run_agent`` (the ``cd-node-agent`` process) and tools that host many simulated nodes in one
process (``tools.sim.scalesim``) build the plugin here, so nothing is wired twice. What stays with the
caller is what a process owns and a host shares or does without: the etcd client, the hardware
handle, the health server, signal handlers, the Kubernetes client and the ResourceSlice.

`compose_plugin` builds the parts; `Plugin.tasks` are the background tasks to keep running (the
node record and daemon record views, the keeper of its prepared claims' records); `Plugin.serve` waits for the node record, reconciles and
opens the DRA socket, then the registration socket (kubelet starts calling only then);
`Plugin.close` closes both sockets, registration first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from libs.cdi.spec_dir import ClaimSpecDir
from libs.hardware.errors import HardwareError
from libs.hardware.interface import NodeHardware
from libs.runtime.backoff import Backoff
from libs.runtime.health import Health
from libs.state.store import Store
from libs.state.watch import PrefixWatcher, watch_prefix
from services.nodeagent.core.checkpoint import Checkpoint, checkpoint_path
from services.nodeagent.core.claim import ClaimSource
from services.nodeagent.settings import AgentSettings
from services.nodeagent.shell.daemon_view import DaemonView
from services.nodeagent.shell.metrics import AgentMetrics
from services.nodeagent.shell.node_view import NodeView
from services.nodeagent.shell.record_keeper import RecordKeeper
from services.nodeagent.shell.state import STORE_FAILURES, DeviceState
from services.nodeagent.shell.store_batch import StoreBatch
from services.nodeagent.wire.driver import ClaimDispatcher, DraServer, dra_socket_path
from services.nodeagent.wire.registration import (
    RegistrationServer,
    RegistrationService,
    registration_socket_path,
)

log = structlog.get_logger(__name__)


@dataclass
class Plugin:
    """One node's kubelet plugin: views of its store records, its claims, its two sockets."""

    node_view: NodeView
    daemons: DaemonView
    state: DeviceState
    records: RecordKeeper
    health: Health
    metrics: AgentMetrics
    kubelet_dir: Path
    register_timeout_s: float
    dra_max_message_bytes: int = 4 * 1024 * 1024
    max_claim_uid_bytes: int = 128
    dra: DraServer | None = None
    registration: RegistrationServer | None = None

    @property
    def node_name(self) -> str:
        return self.node_view.node_name

    @property
    def dra_socket(self) -> Path:
        return dra_socket_path(self.kubelet_dir)

    def tasks(self) -> list[tuple[str, Callable[[], Awaitable[object]]]]:
        """The background tasks to keep running (name, coroutine function)."""
        return [
            ("node-view", self.node_view.run),
            ("daemon-view", self.daemons.run),
            ("prepared-claim-records", self.records.run),
        ]

    async def serve(self, stop: asyncio.Event) -> bool:
        """Wait for the node record, reconcile, open the DRA then the registration socket.

        Joins need the node's address and clique, so kubelet is served only once the record was
        seen. False if `stop` was set first (nothing opened then)."""
        if not await until_registered(self.node_view, stop, self.register_timeout_s):
            return False
        _prewarm(self.state)
        backoff = Backoff(initial=0.2, cap=5.0)
        while not stop.is_set():
            try:
                await self.state.reconcile()
                break
            except STORE_FAILURES as exc:
                delay = backoff.next_delay()
                log.warning(
                    "reconcile failed; retrying",
                    node=self.node_name,
                    error=str(exc) or type(exc).__name__,
                    retry_in_s=delay,
                )
                await asyncio.sleep(delay)
        if stop.is_set():
            return False
        # Follow the held domain's daemon from the start (its restart count is a metric).
        self.daemons.follow(self.state.held_domain())
        self.dra = DraServer(
            ClaimDispatcher(self.state, self.metrics, self.max_claim_uid_bytes),
            self.dra_socket,
            self.dra_max_message_bytes,
        )
        await self.dra.start()
        self.registration = RegistrationServer(
            RegistrationService(self.dra.socket_path, self.health), registration_socket_path(self.kubelet_dir)
        )
        await self.registration.start()
        self.health.set_ready("serving", True)
        return True

    async def close(self) -> None:
        """Stop serving kubelet: the registration socket first, then the DRA socket."""
        self.health.set_ready("serving", False)
        if self.registration is not None:
            await self.registration.stop()
        if self.dra is not None:
            await self.dra.stop()


def compose_plugin(
    store: Store,
    settings: AgentSettings,
    hardware: NodeHardware,
    claims: ClaimSource,
    health: Health,
    metrics: AgentMetrics,
    watch: PrefixWatcher = watch_prefix,
    batch: StoreBatch | None = None,
) -> Plugin:
    """The plugin's parts for ``settings.node_name`` (the node, kubelet and CDI paths, prepare
    and checkpoint tuning of `settings`; its etcd, hardware and process settings are the
    caller's). `watch` opens the views' store watches (a host of many nodes may share them);
    `batch` sends the prepares' single-key store operations (shared with a store claim source,
    a claim's read goes with the domain's)."""
    node_view = NodeView(store, settings.node_name, watch=watch)
    daemons = DaemonView(store, settings.node_name, metrics, watch=watch)
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
            node=settings.node_name,
        ),
        cdi=ClaimSpecDir(Path(settings.cdi_root), host_dev_root=str(host_dev_root(hardware))),
        metrics=metrics,
        prepare_budget_s=settings.prepare_budget_s,
        checkpoint_fsync=settings.checkpoint_fsync,
        batch=batch,
    )
    return Plugin(
        node_view=node_view,
        daemons=daemons,
        state=state,
        records=RecordKeeper(state, node_view, health, watch=watch),
        health=health,
        metrics=metrics,
        kubelet_dir=kubelet_dir,
        register_timeout_s=settings.register_timeout_s,
        dra_max_message_bytes=settings.dra_max_message_bytes,
        max_claim_uid_bytes=settings.max_claim_uid_bytes,
    )


async def until_registered(view: NodeView, stop: asyncio.Event, warn_after_s: float) -> bool:
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


def host_dev_root(hardware: NodeHardware) -> Path:
    """The host directory that plays ``/dev`` for channel device nodes."""
    return hardware.imex_channel_path(0).parent.parent


def _prewarm(state: DeviceState) -> None:
    """Pay the one-off costs (channel major, All-mode spec array) before kubelet calls."""
    try:
        state.cdi.prewarm(state.hardware.imex_channel_major())
    except HardwareError as exc:
        log.info("IMEX channels not available (non-fabric node?)", error=str(exc))
