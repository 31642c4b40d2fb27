"""This node's IMEX daemon readiness as the kubelet plugin sees it: ``daemons/<uid>/<node>``.

The IMEX agent runs the daemons and writes their `DaemonStatus`; a prepare waits until the
record of the domain it prepares for says READY. The view watches ONE key, that of the domain
the plugin last asked about (a node takes part in one domain at a time). The alternative, a watch
of every domain's daemon records filtered to this node, would carry every daemon status change
of the whole cluster to every plugin (by key layout ``daemons/<uid>/<node>`` there is no prefix
of "this node's daemons"): O(nodes) events per plugin, O(nodes²) in total, against O(1) here.
A prepare for another domain moves the watch (one list and one watch creation, milliseconds,
small against the seconds a new daemon takes to start).

The watch is a prefix watch of the key, so a node whose name extends this one's is delivered
too and filtered out here.

It also exports the daemon's restart count (``cd_nodeagent_imex_daemon_restarts``) for the
followed domain.
"""

from __future__ import annotations

import asyncio

import structlog

from libs.contract.names import REASON_DRIVER_TOO_OLD
from libs.gen.computedomain.state import v1 as pb
from libs.state.store import Store
from libs.state.watch import PrefixWatcher, Resync, WatchEvent, watch_prefix
from services.nodeagent.shell.metrics import AgentMetrics

log = structlog.get_logger(__name__)


def status_of(
    key: str, event: WatchEvent[pb.DaemonStatus] | Resync[pb.DaemonStatus]
) -> tuple[bool, pb.DaemonStatus | None]:
    """(applies, status after the item) for one watch item and the watched key."""
    if isinstance(event, Resync):
        return True, next((item.value for item in event.items if item.key == key), None)
    if event.key != key:
        return False, None
    return True, event.value if event.kind == "put" else None


class DaemonView:
    """Implements ``DaemonReadiness`` from the store; `run` is the long-running watch."""

    def __init__(
        self,
        store: Store,
        node_name: str,
        metrics: AgentMetrics | None = None,
        watch: PrefixWatcher = watch_prefix,
    ) -> None:
        self.store = store
        self.node_name = node_name
        self.metrics = metrics
        self._watch_prefix = watch
        # The domain whose record is followed, and that record (None: absent or not read yet).
        self.domain_uid: str | None = None
        self.status: pb.DaemonStatus | None = None
        # The followed domain's record was read at least once since the watch moved to it.
        self._synced = False
        self._changed = asyncio.Event()
        self._retarget = asyncio.Event()

    def follow(self, domain_uid: str | None) -> None:
        """Watch the daemon record of `domain_uid` (None: nothing)."""
        if domain_uid == self.domain_uid:
            return
        self._clear_metric()
        self.domain_uid, self.status, self._synced = domain_uid, None, False
        self._retarget.set()
        self._notify()

    def ready(self, domain_uid: str, node_id: int | None = None) -> bool:
        status = self.status
        return (
            self.domain_uid == domain_uid
            and self._synced
            and status is not None
            and status.state == pb.DaemonState.READY
            and (node_id is None or status.node_id == node_id)
        )

    def refused(self, domain_uid: str) -> bool:
        """The IMEX agent started no daemon and never will (the node's driver is too old)."""
        status = self.status
        return self.domain_uid == domain_uid and status is not None and status.reason == REASON_DRIVER_TOO_OLD

    async def wait_ready(self, domain_uid: str, timeout_s: float, node_id: int | None = None) -> bool:
        """True once this node's daemon for the domain is READY in the store, as IMEX node
        `node_id` when given (the record of a daemon started for an index this node held before
        leaving and rejoining says READY until the IMEX agent restarts it); False if that does
        not happen within `timeout_s`, or at once when the IMEX agent refused to start one."""
        self.follow(domain_uid)
        if self.ready(domain_uid, node_id):
            return True
        log.debug("waiting for the daemon", cd_uid=domain_uid, node=self.node_name)
        try:
            async with asyncio.timeout(timeout_s):
                while not self.ready(domain_uid, node_id):
                    if self.refused(domain_uid):
                        return False
                    await self._changed.wait()
        except TimeoutError:
            return False
        return True

    async def run(self) -> None:
        while True:
            self._retarget.clear()
            domain_uid = self.domain_uid
            if domain_uid is None:
                await self._retarget.wait()
                continue
            watching = asyncio.create_task(self._watch(domain_uid), name=f"daemon-view-{domain_uid}")
            retarget = asyncio.create_task(self._retarget.wait())
            try:
                await asyncio.wait({watching, retarget}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (watching, retarget):
                    task.cancel()
                await asyncio.gather(watching, retarget, return_exceptions=True)
            if watching.done() and not watching.cancelled() and watching.exception() is not None:
                raise watching.exception()  # type: ignore[misc]

    async def _watch(self, domain_uid: str) -> None:
        key = self.store.keys.daemon(domain_uid, self.node_name)
        async for event in self._watch_prefix(self.store, key, pb.DaemonStatus):
            applies, status = status_of(key, event)
            if not applies or self.domain_uid != domain_uid:
                continue
            state = status.state if status is not None else None
            if not self._synced or state != (self.status.state if self.status is not None else None):
                # A state change only: comparing whole records on every status write costs more.
                name = pb.DaemonState(state).name if state is not None else None
                log.debug("daemon status seen", cd_uid=domain_uid, node=self.node_name, state=name)
            self.status, self._synced = status, True
            self._export(domain_uid, status)
            self._notify()

    def _notify(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    def _export(self, domain_uid: str, status: pb.DaemonStatus | None) -> None:
        if self.metrics is None:
            return
        if status is None:
            self._clear_metric()
        else:
            self.metrics.daemon_restarts.labels(cd_uid=domain_uid).set(status.restarts)

    def _clear_metric(self) -> None:
        if self.metrics is not None:
            self.metrics.daemon_restarts.clear()
