"""The store library against a real etcd server."""

from __future__ import annotations

import asyncio

import pytest
import structlog

from libs.gen.computedomain.state import v1 as pb
from libs.state.codec import UndecodableValue, encode, kind_of
from libs.state.config import EtcdConfig
from libs.state.lease import KeptLease
from libs.state.store import Absent, Delete, FirstAbsent, Present, Put, Store
from libs.state.watch import Resync, WatchEvent, watch_prefix
from tests.conftest import unique_prefix
from tools.etcd.server import EtcdServer


async def test_put_get_list_delete(store: Store) -> None:
    k = store.keys
    await store.put(k.node("n1"), pb.Node(name="n1", ip_address="127.0.1.1"))
    await store.put(k.node("n2"), pb.Node(name="n2", ip_address="127.0.1.2"))
    got = await store.get(k.node("n1"), pb.Node)
    assert got is not None and got.value.ip_address == "127.0.1.1" and got.mod_revision > 0
    items, revision = await store.list(k.nodes(), pb.Node)
    assert [i.value.name for i in items] == ["n1", "n2"]
    assert revision >= got.mod_revision
    assert await store.delete(k.node("n1"))
    assert await store.get(k.node("n1"), pb.Node) is None
    assert not await store.delete(k.node("n1"))


async def test_compare_and_swap_detects_conflict(store: Store) -> None:
    key = store.keys.domain("d1")
    await store.put(key, pb.ComputeDomain(uid="d1", name="a"))
    first = await store.get(key, pb.ComputeDomain)
    assert first is not None
    # A concurrent writer changes the value after our read...
    await store.put(key, pb.ComputeDomain(uid="d1", name="b"))
    # ...so our write based on the stale read is refused and nothing is lost.
    assert not await store.compare_and_swap(key, pb.ComputeDomain(uid="d1", name="c"), first.mod_revision)
    now = await store.get(key, pb.ComputeDomain)
    assert now is not None and now.value.name == "b"
    assert await store.compare_and_swap(key, pb.ComputeDomain(uid="d1", name="c"), now.mod_revision)
    assert not await store.create(key, pb.ComputeDomain(uid="d1"))


async def test_200_concurrent_cas_increments_lose_nothing(store: Store) -> None:
    key = store.keys.daemon("d1", "n1")
    await store.put(key, pb.DaemonStatus(restarts=0))

    def bump(current: pb.DaemonStatus | None) -> pb.DaemonStatus:
        assert current is not None
        return pb.DaemonStatus(restarts=current.restarts + 1)

    await asyncio.gather(*(store.update(key, pb.DaemonStatus, bump, max_attempts=1000) for _ in range(200)))
    final = await store.get(key, pb.DaemonStatus)
    assert final is not None and final.value.restarts == 200


async def test_undecodable_value_is_skipped_with_its_key(store: Store) -> None:
    k = store.keys
    await store.put(k.node("good"), pb.Node(name="good"))
    await store.put_raw(k.node("bad"), b"\x00\xffnot a protobuf envelope")
    with structlog.testing.capture_logs() as logs:
        items, _ = await store.list(k.nodes(), pb.Node)
        single = await store.get(k.node("bad"), pb.Node)
    assert [i.value.name for i in items] == ["good"]
    assert single is None
    skipped = [e for e in logs if e["event"] == "skipping undecodable value"]
    assert skipped and all(e["key"] == k.node("bad") for e in skipped)


async def test_an_undecodable_value_reaches_a_watch_as_its_own_event(store: Store) -> None:
    """Neither skipped nor taken for a put: the watcher sees `undecodable` with the key and why,
    then the repaired value as a put."""
    k = store.keys
    it = watch_prefix(store, k.nodes(), pb.Node).__aiter__()
    try:
        assert isinstance(await it.__anext__(), Resync)
        await store.put(k.node("n1"), pb.Node(name="n1"))
        await store.put_raw(k.node("n1"), b"\x00\xffnot a protobuf envelope")
        await store.put(k.node("n1"), pb.Node(name="n1", ip_address="127.0.1.9"))
        events = [await asyncio.wait_for(it.__anext__(), timeout=10) for _ in range(3)]
    finally:
        await it.aclose()
    assert all(isinstance(e, WatchEvent) for e in events)
    kinds = [(e.kind, e.key, e.value is None) for e in events if isinstance(e, WatchEvent)]
    assert kinds == [
        ("put", k.node("n1"), False),
        ("undecodable", k.node("n1"), True),
        ("put", k.node("n1"), False),
    ]
    bad = events[1]
    assert isinstance(bad, WatchEvent) and bad.reason.startswith("not an envelope")


async def test_a_read_modify_write_of_an_undecodable_value_fails_at_once_naming_the_key(store: Store) -> None:
    key = store.keys.daemon("d1", "n1")
    await store.put_raw(key, b"\x00\xffnot a protobuf envelope")
    calls = 0

    def bump(current: pb.DaemonStatus | None) -> pb.DaemonStatus:
        nonlocal calls
        calls += 1
        return pb.DaemonStatus(restarts=1)

    with pytest.raises(UndecodableValue, match=f"undecodable value at {key}"):
        await store.update(key, pb.DaemonStatus, bump)
    assert calls == 0, "the mutation must not run on a value taken for absent"
    with pytest.raises(UndecodableValue, match=key):
        await store.get(key, pb.DaemonStatus, strict=True)
    assert await store.get(key, pb.DaemonStatus) is None  # a lenient read still skips it


async def _collect(it, out: list, stop_after: int) -> None:  # type: ignore[no-untyped-def]
    async for event in it:
        out.append(event)
        if sum(isinstance(e, WatchEvent) for e in out) >= stop_after:
            return


async def test_watch_survives_etcd_restart_without_loss_or_duplicates(private_etcd: EtcdServer) -> None:
    config = EtcdConfig(endpoint=private_etcd.endpoint, prefix=unique_prefix(), timeout_s=2.0)
    writer, reader = Store(config), Store(config)
    await writer.connect()
    await reader.connect()
    try:
        prefix = writer.keys.nodes()
        seen: list[WatchEvent[pb.Node] | Resync[pb.Node]] = []
        total = 40
        consumer = asyncio.create_task(_collect(watch_prefix(reader, prefix, pb.Node), seen, total))
        await asyncio.sleep(0.2)
        for i in range(20):
            await writer.put(writer.keys.node(f"n{i:02d}"), pb.Node(name=f"n{i:02d}"))
        await asyncio.to_thread(private_etcd.restart)
        # Writes that happen while the reader's stream is down must still arrive.
        for i in range(20, total):
            for _ in range(100):
                try:
                    await writer.put(writer.keys.node(f"n{i:02d}"), pb.Node(name=f"n{i:02d}"))
                    break
                except Exception:
                    await asyncio.sleep(0.1)
        await asyncio.wait_for(consumer, timeout=30)
        events = [e for e in seen if isinstance(e, WatchEvent)]
        names = [e.value.name for e in events if e.value is not None]
        assert names == [f"n{i:02d}" for i in range(total)]
        revisions = [e.revision for e in events]
        assert revisions == sorted(set(revisions))
        assert isinstance(seen[0], Resync) and seen[0].items == []
    finally:
        await writer.close()
        await reader.close()


async def test_watch_relists_after_compaction(private_etcd: EtcdServer) -> None:
    config = EtcdConfig(endpoint=private_etcd.endpoint, prefix=unique_prefix(), timeout_s=2.0)
    async with Store(config) as store:
        prefix = store.keys.nodes()
        await store.put(store.keys.node("a"), pb.Node(name="a"))
        watch = watch_prefix(store, prefix, pb.Node)
        # Pretend the consumer last saw revision 1, which compaction then removes.
        it = watch.__aiter__()
        first = await it.__anext__()
        assert isinstance(first, Resync)
        await store.put(store.keys.node("b"), pb.Node(name="b"))
        revision = await store.put(store.keys.node("c"), pb.Node(name="c"))
        await store.client.compact(revision)
        watch.revision = 1
        nxt = await asyncio.wait_for(it.__anext__(), timeout=10)
        assert isinstance(nxt, Resync)
        assert sorted(i.value.name for i in nxt.items) == ["a", "b", "c"]
        assert watch.resyncs == 2
        await it.aclose()


async def test_lease_expiry_fires_loss_callback(store: Store) -> None:
    lost = asyncio.Event()
    acquired: list[int] = []

    async def on_acquired(lease_id: int) -> None:
        acquired.append(lease_id)
        await store.put(store.keys.node("leased"), pb.Node(name="leased"), lease=lease_id)

    async def on_lost(_: int) -> None:
        lost.set()

    kept = KeptLease(store, ttl_s=2, on_acquired=on_acquired, on_lost=on_lost, regrant=False)
    task = asyncio.create_task(kept.run())
    await asyncio.wait_for(kept.acquired.wait(), 5)
    assert await store.get(store.keys.node("leased"), pb.Node) is not None
    # Revoke behind the holder's back: its next refresh finds the lease gone.
    await store.client.revoke_lease(acquired[0])
    await asyncio.wait_for(lost.wait(), timeout=5)
    await asyncio.wait_for(task, timeout=2)
    assert await store.get(store.keys.node("leased"), pb.Node) is None


async def test_key_vanishes_when_holder_stops_refreshing(store: Store) -> None:
    lease_id = await store.grant_lease(1)
    await store.put(store.keys.node("ephemeral"), pb.Node(name="ephemeral"), lease=lease_id)
    assert await store.get(store.keys.node("ephemeral"), pb.Node) is not None
    for _ in range(40):
        if await store.get(store.keys.node("ephemeral"), pb.Node) is None:
            break
        await asyncio.sleep(0.1)
    assert await store.get(store.keys.node("ephemeral"), pb.Node) is None


async def test_watch_delivers_every_key_of_one_transaction(store: Store) -> None:
    from libs.state.store import Delete, Put

    k = store.keys
    it = watch_prefix(store, k.nodes(), pb.Node).__aiter__()
    assert isinstance(await it.__anext__(), Resync)
    await store.txn([], [Put(k.node(f"t{i}"), pb.Node(name=f"t{i}")) for i in range(5)])
    await store.txn([], [Delete(k.nodes(), prefix=True)])
    events = [await asyncio.wait_for(it.__anext__(), 5) for _ in range(10)]
    assert [(e.kind, e.key.rsplit("/", 1)[1]) for e in events if isinstance(e, WatchEvent)] == [
        ("put", f"t{i}") for i in range(5)
    ] + [("delete", f"t{i}") for i in range(5)]
    await it.aclose()


async def test_first_absent_applies_the_first_alternative_whose_guard_is_free(store: Store) -> None:
    k = store.keys
    await store.put(k.node("g0"), pb.Node(name="g0"))
    alternatives = tuple(
        (k.node(f"g{i}"), (Put(k.node(f"g{i}"), pb.Node(name=f"won{i}")),)) for i in range(3)
    )
    first = await store.txn([], [FirstAbsent(alternatives)])
    assert first.succeeded and first.chosen == 1
    got = await store.get(k.node("g1"), pb.Node)
    assert got is not None and got.value.name == "won1"
    second = await store.txn([], [FirstAbsent(alternatives)])
    assert second.chosen == 2
    third = await store.txn([], [FirstAbsent(alternatives)])
    assert third.succeeded and third.chosen is None  # every guard taken: nothing written
    assert (await store.get(k.node("g0"), pb.Node)).value.name == "g0"  # type: ignore[union-attr]


async def test_a_prefix_absence_holds_only_while_no_key_is_under_the_prefix(store: Store) -> None:
    k = store.keys
    members, marker = k.members("dom-a"), k.node("marker")
    neighbour = k.member("dom-ab", "n1")  # a uid that extends this one is another prefix
    await store.put(neighbour, pb.Member(node_name="n1"))
    empty = await store.txn([Absent(members, prefix=True)], [Put(marker, pb.Node(name="empty"))])
    assert empty.succeeded
    await store.put(k.member("dom-a", "n0"), pb.Member(node_name="n0"))
    held = await store.txn([Absent(members, prefix=True)], [Put(marker, pb.Node(name="held"))])
    assert not held.succeeded
    assert (await store.get(marker, pb.Node)).value.name == "empty"  # type: ignore[union-attr]


async def test_a_presence_compare_holds_only_while_the_key_exists(store: Store) -> None:
    k = store.keys
    key, marker = k.node("present"), k.node("present-marker")
    absent = await store.txn([Present(key)], [Put(marker, pb.Node(name="absent"))])
    assert not absent.succeeded and await store.get(marker, pb.Node) is None
    await store.put(key, pb.Node(name="present"))
    present = await store.txn([Present(key)], [Delete(key)])
    assert present.succeeded and await store.get(key, pb.Node) is None


def test_hand_written_envelope_is_what_betterproto_writes() -> None:
    for message in (pb.Node(), pb.Node(name="x" * 300), pb.Member(domain_uid="d", index=5), pb.NodeBinding()):
        expected = bytes(pb.Envelope(schema_version=1, kind=kind_of(type(message)), payload=bytes(message)))
        assert encode(message) == expected


def test_txn_request_is_what_aetcds_helpers_build() -> None:
    """The hand-filled request (no nested copies) has the bytes of aetcd's bottom-up one."""
    import aetcd
    from aetcd import rpc
    from aetcd import transactions as t

    from libs.state.store import Absent, CreatedAt, Delete, Read, Unchanged, txn_request

    def end(key: bytes) -> bytes:
        return bytes(aetcd.utils.prefix_range_end(key))

    alternatives = tuple(
        (f"/i/{i}", (Put(f"/i/{i}", b"claim"), Put("/m", b"member", lease=7), Delete("/x/", prefix=True)))
        for i in range(18)
    )
    ours = txn_request(
        [Absent("/a"), Unchanged("/b", 5), CreatedAt("/c", 9)],
        [FirstAbsent(alternatives), Delete("/d")],
        [Read("/p/", prefix=True), Read("/m")],
    )
    nested: list[object] = []
    for guard, _ in reversed(alternatives):
        writes = [
            t.Put(guard.encode(), b"claim"),
            t.Put(b"/m", b"member", lease=7),
            t.Delete(b"/x/", range_end=end(b"/x/")),
        ]
        nested = [t.Txn([t.Create(guard.encode()) == 0], writes, nested)]
    client = aetcd.Client.__new__(aetcd.Client)
    theirs = rpc.TxnRequest(
        compare=[c.build_message() for c in (t.Create(b"/a") == 0, t.Mod(b"/b") == 5, t.Create(b"/c") == 9)],
        success=client._ops_to_requests([*nested, t.Delete(b"/d")]),
        failure=client._ops_to_requests([t.Get(b"/p/", range_end=end(b"/p/")), t.Get(b"/m")]),
    )
    assert ours.SerializeToString() == theirs.SerializeToString()
