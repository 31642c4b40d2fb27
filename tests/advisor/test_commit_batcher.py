"""Group commit of reservation writes against a real etcd: batching, etcd's limits, a failed
batch and one whose answer was lost, TTL on shared leases, releases, cancelled callers, and a
reserving PlaceStream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import cast

import aetcd.exceptions
import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from libs.gen.computedomain.placement import v1 as pp
from libs.gen.computedomain.state import v1 as pb
from libs.state.codec import encode
from libs.state.config import EtcdConfig
from libs.state.store import Absent, Compare, Op, Put, Store
from services.advisor.advisor import Advisor
from services.advisor.commit_batcher import CommitBatcher
from services.advisor.fleet_feeds import wait_until
from services.advisor.model import Mode, PlacementRequest
from services.advisor.reservations import guard_values, write_reservation
from tests.advisor.fleet import cluster_records, put_nodes
from tests.advisor.harness import advisor_on_store, running_advisor, settings_for
from tests.polling import eventually
from tools.sim.hardware.cluster import ClusterDescription

CLUSTER = ClusterDescription(racks=40, trays_per_rack=18, seed="batcher-test")


@pytest.fixture
async def advisor(store: Store) -> AsyncIterator[Advisor]:
    async with advisor_on_store(store, cluster_records(CLUSTER)) as adv:
        yield adv


def _reserve(num_nodes: int, ttl_s: int = 60, domain: str = "") -> PlacementRequest:
    return PlacementRequest(
        num_nodes=num_nodes,
        mode=Mode.PREFER_SINGLE_CLIQUE,
        reserve=True,
        reservation_ttl_s=ttl_s,
        domain_uid=domain,
    )


def _put_unit(store: Store, name: str, compares: int = 0) -> tuple[list[Absent], list[str]]:
    key = store.keys.reservation(name)
    extra = [Absent(store.keys.node_binding(f"{name}-n{i}")) for i in range(compares)]
    return [Absent(key), *extra], [key]


async def test_concurrent_reservations_share_transactions_and_never_share_a_node(
    advisor: Advisor, store: Store
) -> None:
    sizes = [1 + (i * 7) % 12 for i in range(80)]
    decisions = await asyncio.gather(
        *(advisor.place(_reserve(n, domain=f"job-{i}")) for i, n in enumerate(sizes))
    )
    batcher = advisor.batcher
    assert batcher is not None
    assert all(d.feasible and d.reservation for d in decisions)
    # Grouped: far fewer etcd transactions than reservations.
    assert batcher.units == 80 and batcher.batches <= 30, (batcher.batches, batcher.units)
    handed = [n for d in decisions for n in d.node_names]
    assert len(handed) == sum(sizes) == len(set(handed)), "a node went to two reservations"
    guards, _ = await store.list(store.keys.node_reservations(), pb.Reservation)
    owner = {g.key.rsplit("/", 1)[1]: g.value.id for g in guards}
    for decision in decisions:
        assert decision.reservation is not None
        assert {owner[n] for n in decision.node_names} == {decision.reservation.id}
    # Reservations of one batch (one revision) and one TTL share a lease.
    records, _ = await store.list(store.keys.reservations(), pb.Reservation)
    leases_by_revision: dict[int, set[int]] = {}
    for record in records:
        assert record.lease
        leases_by_revision.setdefault(record.mod_revision, set()).add(record.lease)
    assert len(leases_by_revision) == batcher.batches
    assert all(len(leases) == 1 for leases in leases_by_revision.values())
    assert advisor.fleet.tally.free_count == CLUSTER.node_count - sum(sizes)


async def test_batches_stay_within_etcds_operation_limit(store: Store) -> None:
    """etcd counts a nested transaction's operations against what the outer one leaves: 60 units
    of 60 compares each would be refused in one request; the batcher splits them."""
    batcher = CommitBatcher(store, max_inflight=1)
    units = [_put_unit(store, f"big-{i}", compares=59) for i in range(60)]
    futures = [
        batcher.submit(compares, lambda lease, ms, key=keys[0]: [Put(key, b"x", lease)], keys)
        for compares, keys in units
    ]
    results = await asyncio.gather(*futures)
    assert all(r.succeeded for r in results)
    # At most 128 - 60 = 68 units of 60 compares fit one request: at least two batches.
    assert batcher.batches >= 2 and len({r.revision for r in results}) >= 2
    await batcher.close()


async def test_a_unit_that_loses_its_race_fails_alone_and_clashing_units_never_share_a_batch(
    store: Store,
) -> None:
    batcher = CommitBatcher(store, max_inflight=1)
    blocker = batcher.submit(*_put_unit_args(store, "first"))  # leaves alone at once
    same_a = batcher.submit(*_put_unit_args(store, "contested"))
    same_b = batcher.submit(*_put_unit_args(store, "contested"))
    other = batcher.submit(*_put_unit_args(store, "other"))
    first, a, b, c = await asyncio.gather(blocker, same_a, same_b, other)
    assert first.succeeded and c.succeeded
    # Both wanted the one key: the second waited for the next batch and lost there, alone.
    assert a.succeeded and not b.succeeded
    assert a.revision == c.revision
    assert batcher.batches == 3  # [first], [contested, other], [contested again]
    await batcher.close()


def _put_unit_args(store: Store, name: str) -> tuple[list[Absent], object, list[str]]:
    compares, keys = _put_unit(store, name)
    key = keys[0]

    def build(lease: int, created_ms: int) -> list[Op]:
        return [Put(key, encode(pb.Reservation(id=name, created_unix_ms=created_ms)), lease)]

    return compares, build, keys


async def test_a_refused_batch_fails_only_its_callers(store: Store) -> None:
    batcher = CommitBatcher(store, max_inflight=1, max_bytes=64 * 1024)
    key = store.keys.reservation

    def unit(name: str, payload: bytes, size: int) -> asyncio.Future:  # type: ignore[type-arg]
        return batcher.submit(
            [Absent(key(name))], lambda lease, ms: [Put(key(name), payload, lease)], [key(name)], 30, size
        )

    before = unit("before", b"small", 10)
    # Larger than etcd's request limit (1.5 MiB): etcd refuses the request carrying it.
    huge = unit("huge", b"x" * (2 << 20), 2 << 20)
    after = unit("after", b"small", 10)
    first, failed, last = await asyncio.gather(before, huge, after, return_exceptions=True)
    assert not isinstance(first, BaseException) and first.succeeded
    assert isinstance(failed, Exception), failed
    assert not isinstance(last, BaseException) and last.succeeded
    assert await store.get(key("huge"), pb.Reservation) is None
    assert await store.client.get(key("before").encode()) is not None
    assert batcher.batches == 2
    await batcher.close()


class _AnswerLost:
    """The real store, except that once armed, the next `txn_each` is applied by etcd and its
    answer lost."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.armed = False

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)

    async def txn_each(self, txns: Sequence[tuple[Sequence[Compare], Sequence[Op]]]) -> object:
        answer = await self._store.txn_each(txns)
        if self.armed:
            self.armed = False
            raise aetcd.exceptions.ConnectionFailedError("answer lost")
        return answer


async def test_a_batch_whose_answer_was_lost_is_undone_and_its_lease_mates_stay(store: Store) -> None:
    """etcd applied the batch but the advisor never heard: its callers were told it failed, so
    what it wrote is deleted again. The lease is shared with the batch before it, which stays."""
    lossy = _AnswerLost(store)
    batcher = CommitBatcher(cast(Store, lossy), max_inflight=1)
    keys = store.keys
    kept = await write_reservation(store, ["kept-0", "kept-1"], ["c", "c"], "", "bench", 60, batcher=batcher)
    lossy.armed = True
    with pytest.raises(aetcd.exceptions.ConnectionFailedError):
        await write_reservation(store, ["lost-0", "lost-1"], ["c", "c"], "", "bench", 60, "lost", batcher)
    assert batcher.leases.granted == 1, "the second batch used the first one's lease"

    async def undone() -> bool:
        return await store.get(keys.reservation("lost"), pb.Reservation) is None

    await eventually(undone, "the lost batch's reservation to be undone", 10)
    for node in ("lost-0", "lost-1"):
        assert await store.get(keys.node_reservation(node), pb.Reservation) is None
    assert await store.get(keys.reservation(kept.record.id), pb.Reservation) is not None
    for node in ("kept-0", "kept-1"):
        guard = await store.get(keys.node_reservation(node), pb.Reservation)
        assert guard is not None and guard.lease == kept.lease
    # The lease etcd may have refused is not handed out again: the next batch asks for its own.
    again = await write_reservation(store, ["again-0"], ["c"], "", "bench", 60, batcher=batcher)
    assert again.lease != kept.lease and batcher.leases.granted == 2
    await batcher.close()


async def test_ttl_expires_each_reservation_and_a_release_leaves_its_lease_mates_alone(
    advisor: Advisor, store: Store
) -> None:
    short = [advisor.place(_reserve(2, ttl_s=2)) for _ in range(4)]
    long = [advisor.place(_reserve(3, ttl_s=60)) for _ in range(4)]
    started_ms = time.time() * 1000
    decisions = await asyncio.gather(*short, *long)
    infos = [d.reservation for d in decisions]
    assert all(i is not None for i in infos)
    for info, ttl in zip(infos, [2] * 4 + [60] * 4, strict=True):
        assert info is not None and info.ttl_s == ttl
        # The clock starts before the lease is granted, never after.
        assert started_ms - 50 <= info.expires_unix_ms - ttl * 1000 <= time.time() * 1000
    # Releasing one long reservation removes exactly its keys, not those on the same lease.
    first_long = infos[4]
    assert first_long is not None
    released, nodes = await advisor.release(first_long.id, first_long.holder)
    assert released and sorted(nodes) == sorted(first_long.node_names)
    for info in infos[5:]:
        assert info is not None
        assert await store.get(store.keys.reservation(info.id), pb.Reservation) is not None
    guards, _ = await store.list(store.keys.node_reservations(), pb.Reservation)
    assert not {g.key.rsplit("/", 1)[1] for g in guards} & set(first_long.node_names)
    # The short ones expire with their lease, record and guards together; the inventory frees them.
    short_nodes = {n for info in infos[:4] if info is not None for n in info.node_names}

    async def short_ones_expired() -> bool:
        guards, _ = await store.list(store.keys.node_reservations(), pb.Reservation)
        return not {g.key.rsplit("/", 1)[1] for g in guards} & short_nodes

    await eventually(short_ones_expired, "the 2 s reservations to expire", 15)
    assert all(advisor.fleet.is_free(n) for n in short_nodes) or await wait_until(
        advisor.fleet, lambda: all(advisor.fleet.is_free(n) for n in short_nodes), 5
    )
    for info in infos[5:]:
        assert info is not None
        assert await store.get(store.keys.reservation(info.id), pb.Reservation) is not None


async def test_a_cancelled_caller_leaves_no_reservation_behind(advisor: Advisor, store: Store) -> None:
    tasks = [asyncio.create_task(advisor.place(_reserve(4, domain=f"gone-{i}"))) for i in range(6)]
    await asyncio.sleep(0)  # each has decided, held its nodes and queued its write
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

    async def leftovers() -> int:
        records, _ = await store.list(store.keys.reservations(), pb.Reservation)
        guards, _ = await store.list(store.keys.node_reservations(), pb.Reservation)
        return len(records) + len(guards)

    async def none_left() -> bool:
        return await leftovers() == 0

    await eventually(none_left, "the cancelled callers' reservations to be undone", 10)
    assert await wait_until(advisor.fleet, lambda: advisor.fleet.tally.free_count == CLUSTER.node_count, 5), (
        "cancelled reservations still hide nodes"
    )


def test_guard_values_are_the_messages_bytes() -> None:
    expected = [
        encode(pb.Reservation(id="r1", node_names=[n], domain_uid="d", holder="h"))
        for n in ("a", "rack2-tray3")
    ]
    assert guard_values("r1", ["a", "rack2-tray3"], "d", "h") == expected
    assert guard_values("r1", ["a"], "", "") == [encode(pb.Reservation(id="r1", node_names=["a"]))]


async def test_a_reserving_stream_answers_in_order_and_a_bad_request_leaves_nothing_after_it(
    etcd_config: EtcdConfig, store: Store
) -> None:
    await put_nodes(store, cluster_records(CLUSTER))
    async with running_advisor(settings_for(etcd_config)) as adv:
        channel = adv.channel()
        try:
            stub = adv.stub(channel)
            sizes = [3, 1, 18, 5, 9, 2, 7, 4]
            requests = [pp.PlaceRequest(num_nodes=n, reserve=True, reservation_ttl_seconds=60) for n in sizes]
            replies = [r async for r in stub.place_stream(requests)]
            assert [sum(len(s.node_names) for s in r.placements) for r in replies] == sizes
            assert all(r.reservation_id for r in replies)
            handed = [n for r in replies for s in r.placements for n in s.node_names]
            assert len(handed) == len(set(handed))

            bad = [
                pp.PlaceRequest(num_nodes=2, reserve=True),
                pp.PlaceRequest(num_nodes=0, reserve=True),
                pp.PlaceRequest(num_nodes=3, reserve=True),
            ]
            received = []
            with pytest.raises(GRPCError) as err:
                async for reply in stub.place_stream(bad):
                    received.append(reply)
            assert err.value.status == Status.INVALID_ARGUMENT
            assert len(received) == 1 and received[0].reservation_id
            records, _ = await store.list(store.keys.reservations(), pb.Reservation)
            assert len(records) == len(sizes) + 1, [r.value.node_names for r in records]
        finally:
            channel.close()
