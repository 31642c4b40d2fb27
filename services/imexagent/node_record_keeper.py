"""The node's record in the store, kept on a lease by `NodeRecordKeeper`.

The Node record (address, clique, GPUs, health, versions) lives at ``nodes/<node>`` attached to the
IMEX agent's `KeptLease`: while ``cd-imex-agent`` runs the lease is refreshed, and when it dies or is
cut off the record vanishes after one TTL, which is how the controller learns of node loss (a
restart or upgrade of the kubelet plugin changes nothing here). After a lost lease
the record is written again on a new one. The agent owns the key: it watches it, and when the
record is deleted (an operator's ``etcdctl del``), overwritten (a restore from an older backup,
another writer, no lease) or undecodable, it writes its own record again at once; health shows
the ``registered`` gate closed, with the reason, until it is back. Hardware health events
(fabric state, clique, health) rewrite the record. A clique that is not settled yet (fabric IN_PROGRESS) or unreadable hardware
is reported in ``fabric_message`` and retried; it never stops the agent (upstream #1264).

Pure core: `build_node_record` turns a hardware snapshot into the record. Thin shell:
`NodeRecordKeeper`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib import metadata

import structlog

from libs.gen.computedomain.state import v1 as pb
from libs.hardware import CliqueStatus, FabricState, GpuHealth, HardwareError, HardwareSnapshot, NodeHardware
from libs.hardware.clique import parse_clique_id
from libs.hardware.health import DEFAULT_QUERY_TIMEOUT_S
from libs.hardware.off_loop import OffLoopCalls
from libs.runtime.backoff import Backoff
from libs.runtime.health import Health
from libs.state.codec import UndecodableValue
from libs.state.lease import KeptLease
from libs.state.node_record import clique_settled
from libs.state.store import Store, with_retries
from libs.state.watch import PrefixWatcher, Resync, watch_prefix

log = structlog.get_logger(__name__)


def _agent_version() -> str:
    try:
        return metadata.version("computedomains")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


AGENT_VERSION = _agent_version()


@dataclass(frozen=True)
class RecordKeeperSettings:
    # Lease TTL of the Node record: node loss is noticed this long after the agent stops.
    lease_ttl_s: int = 5
    # This node's IMEX / peer address. "" = the simulated hardware's own address; required with
    # real hardware (the pod IP or host IP of the node agent).
    node_ip: str = ""
    kubelet_dir: str = "/var/lib/kubelet"
    cdi_root: str = "/var/run/cdi"
    agent_version: str = AGENT_VERSION
    # While the fabric is coming up or the hardware cannot be read, look again this often.
    unsettled_retry_s: float = 1.0
    # Hardware health poll interval; None = the backend's default.
    health_poll_interval_s: float | None = None
    # A hardware query (NVML) taking longer than this is reported as stalled in the record.
    hardware_query_timeout_s: float = DEFAULT_QUERY_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.lease_ttl_s < 1:
            raise ValueError(f"invalid node lease TTL {self.lease_ttl_s!r}: must be >= 1 s")
        if self.unsettled_retry_s <= 0:
            raise ValueError(f"invalid unsettled retry interval {self.unsettled_retry_s!r}: must be > 0")


def node_address(hardware: NodeHardware, configured: str) -> str:
    """The address peers reach this node at: the configured one, else the simulated node's own."""
    if configured:
        return configured
    simulated = getattr(hardware, "node", None)
    address = getattr(simulated, "address", "")
    if isinstance(address, str) and address:
        return address
    raise ValueError(
        "this node's IP address is not configured: set --node-ip (the address IMEX peers use) "
        "when running on real hardware"
    )


_FABRIC_STATES = {
    FabricState.NOT_SUPPORTED: pb.FabricState.NOT_SUPPORTED,
    FabricState.NOT_STARTED: pb.FabricState.NOT_STARTED,
    FabricState.IN_PROGRESS: pb.FabricState.IN_PROGRESS,
    FabricState.COMPLETED: pb.FabricState.COMPLETED,
}
_HEALTH = {
    GpuHealth.HEALTHY: pb.Health.HEALTHY,
    GpuHealth.DEGRADED: pb.Health.DEGRADED,
    GpuHealth.UNHEALTHY: pb.Health.UNHEALTHY,
}


def build_node_record(
    name: str,
    address: str,
    snapshot: HardwareSnapshot | None,
    driver_version: str,
    settings: RecordKeeperSettings,
    hardware_error: str = "",
) -> pb.Node:
    """The Node record for a hardware snapshot (None: never read successfully).

    ``clique_id`` is set only for a settled fabric clique; while the fabric is PENDING or in
    ERROR it is "" and ``fabric_message`` says why, so nobody mistakes the node for a non-fabric
    one. A hardware read error makes health UNKNOWN and is named in ``fabric_message``.
    """
    node = pb.Node(
        name=name,
        ip_address=address,
        agent_version=settings.agent_version,
        driver_version=driver_version,
        kubelet_dir=settings.kubelet_dir,
        cdi_root=settings.cdi_root,
        health=pb.Health.UNKNOWN,
    )
    messages: list[str] = []
    if snapshot is not None:
        clique = snapshot.clique
        node.gpus = [
            pb.Gpu(
                uuid=g.uuid,
                index=g.index,
                memory_bytes=g.memory_bytes,
                clique_id=clique.clique_id,
                fabric_state=_FABRIC_STATES.get(g.fabric.state, pb.FabricState.UNSPECIFIED),
                health=_HEALTH.get(g.health, pb.Health.UNKNOWN),
            )
            for g in snapshot.gpus
        ]
        if clique.status is CliqueStatus.FABRIC:
            node.clique_id = clique.clique_id
            node.cluster_uuid = parse_clique_id(clique.clique_id)[0]
        elif clique.status is not CliqueStatus.NON_FABRIC:
            messages.append(f"clique {clique.status.value}: {clique.reason}")
        if not hardware_error:
            node.health = _HEALTH.get(snapshot.health, pb.Health.UNKNOWN)
    if hardware_error:
        messages.append(f"hardware query failed: {hardware_error}")
    node.fabric_message = "; ".join(messages)
    return node


def _without_timestamp(node: pb.Node) -> bytes:
    copy = pb.Node().parse(bytes(node))
    copy.registered_unix_ms = 0
    return bytes(copy)


class NodeRecordKeeper:
    """Keeps ``nodes/<node>`` on a kept lease and in step with the hardware."""

    def __init__(
        self,
        store: Store,
        node_name: str,
        hardware: NodeHardware,
        settings: RecordKeeperSettings,
        watch: PrefixWatcher = watch_prefix,
    ) -> None:
        self.store = store
        # How our own key is watched (a host of many simulated agents shares the plugin's watch).
        self._watch = watch
        self.node_name = node_name
        self.hardware = hardware
        self.settings = settings
        self.address = node_address(hardware, settings.node_ip)
        self.key = store.keys.node(node_name)
        self.lease = KeptLease(
            store, settings.lease_ttl_s, on_acquired=self._on_lease_acquired, on_lost=self._on_lease_lost
        )
        self._calls = OffLoopCalls(settings.hardware_query_timeout_s, name=f"hardware-{node_name}")
        # Where a failing or stalled hardware query is shown (set by the agent that serves health).
        self.health: Health | None = None
        self._snapshot: HardwareSnapshot | None = None
        self._hardware_error = ""
        self._driver_version = ""
        self._node = self._build()
        self._version = 0
        # Replaced on every change; `changes()` waits on the one it saw.
        self._changed = asyncio.Event()
        self._registered = asyncio.Event()
        # Serialises record writes: the lease callback and hardware updates both write.
        self._write_lock = asyncio.Lock()
        self._written: bytes | None = None
        self._written_lease: int | None = None
        # Store revision of our last write: the watch skips its own echo.
        self._written_revision = 0
        # Set by the watch of our key when it changed under us; the keeper checks and rewrites.
        self._check_wanted = asyncio.Event()
        # Records rewritten because they went missing or were overwritten (tests, metrics).
        self.rewrites = 0

    @property
    def node(self) -> pb.Node:
        """The latest record (as written, or about to be written)."""
        return self._node

    @property
    def registered(self) -> bool:
        return self._registered.is_set()

    async def wait_registered(self, timeout_s: float) -> pb.Node:
        """The record once it is in the store; raises TimeoutError after `timeout_s`."""
        async with asyncio.timeout(timeout_s):
            await self._registered.wait()
        return self._node

    async def changes(self) -> AsyncIterator[pb.Node]:
        """The current record, then every changed record (latest only if several came quickly)."""
        seen = -1
        while True:
            if self._version == seen:
                await self._changed.wait()
                continue
            seen = self._version
            yield self._node

    async def run(self) -> None:
        await self._refresh_hardware()
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self.lease.run(), name=f"node-lease-{self.node_name}")
            tasks.create_task(self._follow_hardware(), name=f"node-hardware-{self.node_name}")
            tasks.create_task(self._watch_record(), name=f"node-record-watch-{self.node_name}")
            tasks.create_task(self._keep_record(), name=f"node-record-keeper-{self.node_name}")

    async def deregister(self) -> None:
        """Remove the record now (decommissioning); a plain shutdown lets it expire instead."""
        await self.lease.revoke()
        self._set_registered(False, "deregistered")

    def _build(self) -> pb.Node:
        return build_node_record(
            self.node_name,
            self.address,
            self._snapshot,
            self._driver_version,
            self.settings,
            self._hardware_error,
        )

    async def _refresh_hardware(self, timeout_s: float | None = None) -> None:
        """Read the hardware once, off the event loop; keeps the last good snapshot when the read
        fails or stalls (a hung NVML shows in the record, the lease is kept meanwhile)."""
        try:
            snapshot = await self._calls.call(self.hardware.snapshot, "snapshot", timeout_s)
            self._driver_version = await self._calls.call(
                self.hardware.driver_version, "driver_version", timeout_s
            )
        except HardwareError as exc:
            if self._hardware_error != str(exc):
                log.warning("hardware query failed", node=self.node_name, error=str(exc))
            self._hardware_error = str(exc)
            if self.health is not None:
                self.health.set_warning("hardware", f"hardware query failed: {exc}")
        else:
            self._snapshot = snapshot
            self._hardware_error = ""
            if self.health is not None:
                self.health.clear_warning("hardware")
        self._node = self._build()

    def _publish_change(self) -> None:
        self._version += 1
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    async def _on_lease_acquired(self, lease_id: int) -> None:
        # The lease is refreshed only after this returns: a stalled query must not outlast it.
        await self._refresh_hardware(timeout_s=self.settings.lease_ttl_s / 4)
        await self._write(lease_id, force=True)
        self._set_registered(True)
        log.info(
            "node registered",
            node=self.node_name,
            clique=self._node.clique_id,
            address=self.address,
            lease=lease_id,
            fabric_message=self._node.fabric_message or None,
        )

    async def _write(self, lease_id: int, force: bool = False) -> None:
        async with self._write_lock:
            node = self._node
            content = _without_timestamp(node)
            if not force and content == self._written and lease_id == self._written_lease:
                return
            node.registered_unix_ms = int(time.time() * 1000)
            self._written_revision = await with_retries(
                lambda: self.store.put(self.key, node, lease=lease_id),
                what=f"write node record {self.node_name}",
                deadline_s=float(self.settings.lease_ttl_s),
            )
            changed = content != self._written
            self._written, self._written_lease = content, lease_id
        if changed:
            self._publish_change()

    async def _rewrite_if_changed(self) -> None:
        before = _without_timestamp(self._node)
        await self._refresh_hardware()
        if _without_timestamp(self._node) == before:
            return
        lease_id = self.lease.lease_id
        if lease_id is None:
            # Not registered right now; the next lease grant writes the latest record.
            self._publish_change()
            return
        try:
            await self._write(lease_id)
        except Exception as exc:
            # The lease may be gone under us; KeptLease re-grants and rewrites the record.
            log.warning(
                "node record update failed", node=self.node_name, error=str(exc) or type(exc).__name__
            )

    async def _follow_hardware(self) -> None:
        """Rewrite the record on hardware changes; poll faster while the picture is unsettled."""
        backoff = Backoff(initial=self.settings.unsettled_retry_s, cap=self.settings.unsettled_retry_s * 4)
        while True:
            if self._snapshot is None or self._hardware_error or not clique_settled(self._node):
                await asyncio.sleep(backoff.next_delay())
                await self._rewrite_if_changed()
                continue
            backoff.reset()
            events = self.hardware.health_events(
                since=self._snapshot, interval=self.settings.health_poll_interval_s, calls=self._calls
            )
            try:
                async for event in events:
                    log.info(
                        "hardware changed",
                        node=self.node_name,
                        changes=list(event.changes),
                        error=event.error or None,
                    )
                    await self._rewrite_if_changed()
                    if self._hardware_error or not clique_settled(self._node):
                        break
            finally:
                close = getattr(events, "aclose", None)
                if close is not None:
                    with contextlib.suppress(Exception):
                        await close()

    def _set_registered(self, registered: bool, problem: str = "") -> None:
        """The ``registered`` readiness gate: open only while our record is in the store."""
        if registered:
            self._registered.set()
        else:
            self._registered.clear()
        if self.health is None:
            return
        self.health.set_ready("registered", registered)
        if registered:
            self.health.clear_warning("node-record")
        else:
            self.health.set_warning("node-record", f"node record {self.key} {problem}")

    async def _on_lease_lost(self, lease_id: int) -> None:
        # The record went with the lease; the next grant writes it again.
        self._set_registered(False, f"lapsed with its lease {lease_id}; registering on a new lease")

    async def _watch_record(self) -> None:
        """Follow our own key; any change that is not our write asks the keeper to look."""
        async for item in self._watch(self.store, self.key, pb.Node):
            if isinstance(item, Resync):
                self._check_wanted.set()
            # The key as a prefix also covers longer names (tray1 / tray10).
            elif item.key == self.key and item.revision != self._written_revision:
                self._check_wanted.set()

    async def _keep_record(self) -> None:
        """Write our record again whenever the store lost it or holds something else there."""
        backoff = Backoff(initial=0.05, cap=self.settings.lease_ttl_s / 4)
        while True:
            await self._check_wanted.wait()
            self._check_wanted.clear()
            while True:
                try:
                    await self._heal_once()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    delay = backoff.next_delay()
                    log.warning(
                        "node record check failed; retrying",
                        node=self.node_name,
                        error=str(exc) or type(exc).__name__,
                        retry_in_s=round(delay, 3),
                    )
                    await asyncio.sleep(delay)
                    continue
                backoff.reset()
                break

    async def _record_problem(self, lease_id: int) -> str | None:
        """What is wrong with the stored record (None: it is the one we wrote, on our lease)."""
        try:
            item = await self.store.get(self.key, pb.Node, strict=True)
        except UndecodableValue as exc:
            return f"was overwritten with an undecodable value ({exc.reason})"
        if item is None:
            return "is missing (deleted)"
        if item.mod_revision == self._written_revision and item.lease == lease_id:
            return None
        if item.lease != lease_id:
            return f"was overwritten without this agent's lease {lease_id} (lease {item.lease or 'none'})"
        if _without_timestamp(item.value) != self._written:
            return "was overwritten with another record"
        return None

    async def _heal_once(self) -> None:
        lease_id = self.lease.lease_id
        # Before the first write on a lease, the lease callback writes the record.
        if lease_id is None or lease_id != self._written_lease:
            return
        async with self._write_lock:  # a write in flight is not taken for a foreign one
            problem = await self._record_problem(lease_id)
        if problem is None or lease_id != self.lease.lease_id:
            return
        self._set_registered(False, f"{problem}; writing it again")
        log.warning("node record lost from the store; writing it again", node=self.node_name, problem=problem)
        await self._write(lease_id, force=True)
        self.rewrites += 1
        self._set_registered(True)
        log.info("node record written again", node=self.node_name, lease=lease_id, problem=problem)
