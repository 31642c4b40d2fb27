"""The plugin's store views: its node record and its IMEX daemon's readiness (real etcd)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.gen.computedomain.state import v1 as pb
from libs.state.store import Store, Versioned
from libs.state.watch import Resync, WatchEvent
from services.nodeagent.shell.daemon_view import DaemonView
from services.nodeagent.shell.metrics import AgentMetrics
from services.nodeagent.shell.node_view import NodeRecordState, NodeView
from tests.nodeagent.agent_fakes import CLIQUE, fabric_node, new_uid
from tests.polling import eventually

KEY = "/p/nodes/n1"


async def running(run: Callable[[], Awaitable[object]]) -> asyncio.Task[object]:
    task: asyncio.Task[object] = asyncio.create_task(run())  # type: ignore[arg-type]
    await asyncio.sleep(0)
    return task


async def stop(task: asyncio.Task[object]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


# ---- the node record -------------------------------------------------------------------------

_items = st.one_of(
    st.builds(
        lambda key, clique: ("put", key, clique),
        st.sampled_from([KEY, KEY + "0", "/p/nodes/n2"]),
        st.sampled_from(["", CLIQUE]),
    ),
    st.builds(lambda key: ("delete", key, ""), st.sampled_from([KEY, KEY + "0"])),
    st.builds(
        lambda present, clique: ("resync", present, clique), st.booleans(), st.sampled_from(["", CLIQUE])
    ),
)


@given(st.lists(_items, max_size=12))
def test_node_record_state_keeps_the_last_record_of_its_own_key(items: list[tuple[str, object, str]]) -> None:
    state = NodeRecordState()
    last: pb.Node | None = None
    present = False
    for revision, (kind, arg, clique) in enumerate(items, 1):
        node = pb.Node(name="n1", clique_id=clique)
        event: WatchEvent[pb.Node] | Resync[pb.Node]
        if kind == "resync":
            listed = [Versioned("/p/nodes/n10", pb.Node(name="n10"), 1, 1)]
            if arg:
                listed.append(Versioned(KEY, node, revision, 1))
            event = Resync(listed, revision)
            if arg:
                last, present = node, True
            else:
                present = False
        else:
            key = str(arg)
            event = WatchEvent(kind, key, node if kind == "put" else None, revision)  # type: ignore[arg-type]
            if key == KEY:
                if kind == "put":
                    last, present = node, True
                else:
                    present = False
        state = state.apply(KEY, event)
        assert (state.last, state.present) == (last, present)


async def test_node_view_waits_for_the_record_keeps_it_after_it_lapses_and_reports_changes(
    store: Store,
) -> None:
    view = NodeView(store, "rack0-tray1")
    task = await running(view.run)
    try:
        with pytest.raises(TimeoutError):
            await view.wait_registered(0.2)
        assert view.node.name == "rack0-tray1" and not view.registered
        changes = view.changes()
        # A node whose name extends ours is not ours.
        await store.put(store.keys.node("rack0-tray10"), fabric_node("rack0-tray10", "127.9.0.10"))
        await store.put(store.keys.node("rack0-tray1"), fabric_node("rack0-tray1", "127.9.0.1"))
        got = await view.wait_registered(5)
        assert (got.name, got.ip_address, got.clique_id) == ("rack0-tray1", "127.9.0.1", CLIQUE)
        assert (await anext(changes)).ip_address == "127.9.0.1"

        await store.delete(store.keys.node("rack0-tray1"))  # the IMEX agent's lease lapsed
        await eventually(lambda: not view.present, "the view to see the record gone", 5.0)
        assert view.node.ip_address == "127.9.0.1" and view.registered

        # Same content written again (new lease, new time stamp): no change to report.
        again = fabric_node("rack0-tray1", "127.9.0.1")
        again.registered_unix_ms = 12345
        await store.put(store.keys.node("rack0-tray1"), again)
        await eventually(lambda: view.present, "the view to see the record again", 5.0)
        moved = fabric_node("rack0-tray1", "127.9.0.1", clique="")
        moved.fabric_message = "clique pending"
        await store.put(store.keys.node("rack0-tray1"), moved)
        changed = await asyncio.wait_for(anext(changes), 5)
        assert changed.clique_id == "" and changed.fabric_message == "clique pending"
    finally:
        await stop(task)


# ---- daemon readiness ------------------------------------------------------------------------


def status(domain_uid: str, node: str, state: pb.DaemonState, restarts: int = 0) -> pb.DaemonStatus:
    return pb.DaemonStatus(domain_uid=domain_uid, node_name=node, state=state, restarts=restarts)


@pytest.fixture
async def daemon_view(store: Store) -> AsyncIterator[DaemonView]:
    view = DaemonView(store, "rack0-tray1", AgentMetrics())
    task = await running(view.run)
    yield view
    await stop(task)


async def seen_by(view: DaemonView, state: pb.DaemonState, node_id: int | None = None) -> None:
    """Wait until the view holds a record in `state` (a waiter woken by it has looked at it too)."""
    for _ in range(500):
        current = view.status
        if view._synced and current is not None and current.state == state:
            if node_id is None or current.node_id == node_id:
                for _ in range(3):
                    await asyncio.sleep(0)  # the waiter's turn to look at the record
                return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the daemon view never held a {pb.DaemonState(state).name} record")


async def test_wait_ready_returns_when_the_record_says_ready(store: Store, daemon_view: DaemonView) -> None:
    uid = new_uid()
    key = store.keys.daemon(uid, "rack0-tray1")
    await store.put(key, status(uid, "rack0-tray1", pb.DaemonState.STARTING))
    waiting = asyncio.create_task(daemon_view.wait_ready(uid, 10))
    await seen_by(daemon_view, pb.DaemonState.STARTING)
    assert not waiting.done()
    # Another node's daemon of the same domain (a name extending ours) does not count.
    await store.put(store.keys.daemon(uid, "rack0-tray10"), status(uid, "rack0-tray10", pb.DaemonState.READY))
    await store.put(key, status(uid, "rack0-tray1", pb.DaemonState.READY, restarts=2))
    assert await asyncio.wait_for(waiting, 5)
    assert await daemon_view.wait_ready(uid, 0)  # known READY: at once
    sample = daemon_view.metrics.registry.get_sample_value(  # type: ignore[union-attr]
        "cd_nodeagent_imex_daemon_restarts", {"cd_uid": uid}
    )
    assert sample == 2.0


async def test_wait_ready_times_out_and_follows_a_new_domain(store: Store, daemon_view: DaemonView) -> None:
    first, second = new_uid(), new_uid()
    await store.put(
        store.keys.daemon(first, "rack0-tray1"), status(first, "rack0-tray1", pb.DaemonState.READY)
    )
    assert await daemon_view.wait_ready(first, 5)
    assert not await daemon_view.wait_ready(second, 0.3)  # no record for the new domain
    assert not daemon_view.ready(first)  # the view follows one domain: the one asked about last
    await store.put(
        store.keys.daemon(second, "rack0-tray1"), status(second, "rack0-tray1", pb.DaemonState.READY)
    )
    assert await daemon_view.wait_ready(second, 5)
    await store.delete(store.keys.daemon(second, "rack0-tray1"))  # member gone: daemon stopped
    await eventually(lambda: not daemon_view.ready(second), "the deleted status to end readiness", 5.0)
    assert not await daemon_view.wait_ready(second, 0.2)


async def test_moving_between_domains_at_once_never_misses_a_ready(
    store: Store, daemon_view: DaemonView
) -> None:
    """A READY known from the first listing answers before the watch exists; moving on at
    once cancels that watch mid-creation (aetcd then cross-wired the next one)."""
    for _ in range(5):
        first, second = new_uid(), new_uid()
        await store.put(
            store.keys.daemon(first, "rack0-tray1"), status(first, "rack0-tray1", pb.DaemonState.READY)
        )
        assert await daemon_view.wait_ready(first, 5)
        waiting = asyncio.create_task(daemon_view.wait_ready(second, 5))
        await asyncio.sleep(0.05)
        await store.put(
            store.keys.daemon(second, "rack0-tray1"), status(second, "rack0-tray1", pb.DaemonState.READY)
        )
        assert await waiting


async def test_a_ready_daemon_of_another_index_does_not_count(store: Store, daemon_view: DaemonView) -> None:
    """The node left and rejoined at another index: the old daemon's READY is not the new one's."""
    uid = new_uid()
    key = store.keys.daemon(uid, "rack0-tray1")
    old = status(uid, "rack0-tray1", pb.DaemonState.READY)
    old.node_id = 0
    await store.put(key, old)
    assert await daemon_view.wait_ready(uid, 5, node_id=0)
    waiting = asyncio.create_task(daemon_view.wait_ready(uid, 10, node_id=1))
    await seen_by(daemon_view, pb.DaemonState.READY, node_id=0)
    assert not waiting.done()
    new = status(uid, "rack0-tray1", pb.DaemonState.READY)
    new.node_id = 1
    await store.put(key, new)
    assert await asyncio.wait_for(waiting, 5)
