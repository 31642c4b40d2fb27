"""This node's record (``nodes/<node>``) as the kubelet plugin sees it: fed by a store watch.

The IMEX agent writes the record on its lease; the plugin only reads it. The view keeps the last
record it saw even after the key lapses: an IMEX agent that restarts (or is cut off for a lease
TTL) must not stop the plugin from answering kubelet for claims of this node, and the address and
clique a plugin uses for a join do not change because the record is briefly absent.

The watch is on the key as a prefix (``PrefixWatch`` survives etcd restarts and compaction), so a
node whose name extends this one's (``tray1`` / ``tray10``) is delivered too and filtered here.
Node records change rarely (hardware events, lease renewals do not rewrite them), so that costs
next to nothing.

Pure core: `NodeRecordState.apply`. Thin shell: `NodeView`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import structlog

from libs.gen.computedomain.state import v1 as pb
from libs.state.store import Store
from libs.state.watch import PrefixWatcher, Resync, WatchEvent, watch_prefix

log = structlog.get_logger(__name__)


def record_content(node: pb.Node) -> bytes:
    """The record without its write time: what a change of the node means to the plugin."""
    copy = pb.Node().parse(bytes(node))
    copy.registered_unix_ms = 0
    return bytes(copy)


@dataclass(frozen=True, slots=True)
class NodeRecordState:
    """What the view knows: the last record seen (kept after it lapses) and whether it is there."""

    last: pb.Node | None = None
    present: bool = False

    def apply(self, key: str, event: WatchEvent[pb.Node] | Resync[pb.Node]) -> NodeRecordState:
        """The state after one watch item; items for other keys change nothing."""
        if isinstance(event, Resync):
            found = next((item.value for item in event.items if item.key == key), None)
            if found is None:
                return NodeRecordState(self.last, False)
            return NodeRecordState(found, True)
        if event.key != key:
            return self
        if event.kind == "delete" or event.value is None:
            return NodeRecordState(self.last, False)
        return NodeRecordState(event.value, True)


class NodeView:
    """Follows ``nodes/<node>``; `run` is the long-running watch."""

    def __init__(self, store: Store, node_name: str, watch: PrefixWatcher = watch_prefix) -> None:
        self.store = store
        self.node_name = node_name
        self._watch = watch
        self.key = store.keys.node(node_name)
        self.state = NodeRecordState()
        self._seen = asyncio.Event()
        # Bumped when the record's content changes; `changes()` waits on the event it saw.
        self._version = 0
        self._changed = asyncio.Event()

    @property
    def node(self) -> pb.Node:
        """The last record seen (a bare record with the node's name before the first one)."""
        return self.state.last if self.state.last is not None else pb.Node(name=self.node_name)

    @property
    def registered(self) -> bool:
        """A record has been seen at least once (it may have lapsed since)."""
        return self._seen.is_set()

    @property
    def present(self) -> bool:
        """The record is in the store now (the IMEX agent holds its lease)."""
        return self.state.present

    async def wait_registered(self, timeout_s: float) -> pb.Node:
        """The record once one was seen; raises TimeoutError after `timeout_s`."""
        async with asyncio.timeout(timeout_s):
            await self._seen.wait()
        return self.node

    async def changes(self) -> AsyncIterator[pb.Node]:
        """The current record once seen, then every changed one (latest only if several came quickly)."""
        seen = 0
        while True:
            if self._version == seen:
                await self._changed.wait()
                continue
            seen = self._version
            yield self.node

    def apply(self, event: WatchEvent[pb.Node] | Resync[pb.Node]) -> None:
        before = self.state
        self.state = before.apply(self.key, event)
        if before.present != self.state.present:
            log.info(
                "node record " + ("present" if self.state.present else "absent; keeping the last one seen"),
                node=self.node_name,
            )
        last = self.state.last
        if last is None:
            return
        if before.last is None or record_content(before.last) != record_content(last):
            self._version += 1
            event_, self._changed = self._changed, asyncio.Event()
            event_.set()
        self._seen.set()

    async def run(self) -> None:
        async for event in self._watch(self.store, self.key, pb.Node):
            self.apply(event)
