"""The plugin owns its PreparedClaim records: lost from the store, they are written again.

An operator's ``etcdctl del``, a garbled value or a restore from an older backup can take a
prepared claim's record (``preparations/<node>/<claim uid>``) away while the claim is still
prepared here. The controller then counts the node without claims of its domain: a LOST member
that comes back is released, and loses its index, instead of being made ACTIVE again. The keeper
watches this node's records and asks `DeviceState.restore_record` to write back each one the
checkpoint still holds. It starts after the start-up reconcile; the watch's first listing checks
every held claim, so records lost while the plugin was down are restored too.

Records of a node whose IMEX record is absent are left alone: the controller deletes the prepared
claims of a node it found gone, and writing them back would fight it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import structlog

from libs.gen.computedomain.state import v1 as pb
from libs.runtime.backoff import Backoff
from libs.runtime.health import Health
from libs.state.keys import Keys
from libs.state.watch import PrefixWatcher, Resync, watch_prefix
from services.nodeagent.shell.node_view import NodeView
from services.nodeagent.shell.state import STORE_FAILURES, DeviceState

log = structlog.get_logger(__name__)

HEALTH_KEY = "prepared-claim-records"


class RecordKeeper:
    """Follows ``preparations/<node>/`` and restores the records of claims held here."""

    def __init__(
        self, state: DeviceState, node_view: NodeView, health: Health, watch: PrefixWatcher = watch_prefix
    ) -> None:
        self.state = state
        self.node_view = node_view
        self.health = health
        self._watch = watch
        self._wanted: set[str] = set()
        self._changed = asyncio.Event()
        # Records written again (tests, logs).
        self.restored = 0

    async def run(self) -> None:
        await self.state.reconciled.wait()
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._follow(), name=f"prepared-claims-watch-{self.node_view.node_name}")
            tasks.create_task(self._restore(), name=f"prepared-claims-keeper-{self.node_view.node_name}")

    async def _follow(self) -> None:
        store = self.state.store
        prefix = store.keys.preparations(self.node_view.node_name)
        async for item in self._watch(store, prefix, pb.PreparedClaim):
            if isinstance(item, Resync):
                listed = {Keys.last_segment(i.key) for i in item.items}
                self._want(uid for uid in self.state.checkpoint.entries if uid not in listed)
            elif item.kind != "put":  # a delete, or a value this build cannot read
                self._want([Keys.last_segment(item.key)])

    def _want(self, claim_uids: Iterable[str]) -> None:
        held = self.state.checkpoint.entries
        wanted = {uid for uid in claim_uids if uid in held}
        if wanted:
            self._wanted |= wanted
            self._changed.set()

    async def _restore(self) -> None:
        backoff = Backoff(initial=0.05, cap=2.0)
        while True:
            await self._changed.wait()
            self._changed.clear()
            if self._wanted and not self.node_view.present:
                # The node counts as gone (see the module docstring).
                log.info(
                    "prepared claim records gone while the node record is absent; leaving them",
                    node=self.node_view.node_name,
                    claims=sorted(self._wanted),
                )
                self._wanted.clear()
            if self._wanted:
                self.health.set_warning(
                    HEALTH_KEY, f"records of prepared claims {sorted(self._wanted)} lost; writing them again"
                )
            while self._wanted:
                uid = min(self._wanted)
                try:
                    problem = await self.state.restore_record(uid)
                except STORE_FAILURES as exc:
                    delay = backoff.next_delay()
                    self.health.set_warning(
                        HEALTH_KEY, f"prepared claim {uid}'s record lost; writing it again failed: {exc}"
                    )
                    log.warning(
                        "prepared claim record rewrite failed; retrying",
                        claim_uid=uid,
                        node=self.node_view.node_name,
                        error=str(exc) or type(exc).__name__,
                        retry_in_s=round(delay, 3),
                    )
                    await asyncio.sleep(delay)
                    continue
                backoff.reset()
                self._wanted.discard(uid)
                if problem is not None:
                    self.restored += 1
                    log.warning(
                        "prepared claim record lost from the store; written again",
                        claim_uid=uid,
                        node=self.node_view.node_name,
                        problem=problem,
                    )
            self.health.clear_warning(HEALTH_KEY)
