"""The PlacementAdvisor gRPC API against a real etcd: placing, reserving, capacity, bad input, races."""

from __future__ import annotations

import asyncio
import random

import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from libs.gen.computedomain.placement import v1 as pp
from libs.gen.computedomain.state import v1 as pb
from libs.state.config import EtcdConfig
from libs.state.store import Store
from services.advisor.fleet_feeds import wait_until
from tests.advisor.fleet import cluster_records, put_nodes
from tests.advisor.harness import running_advisor, settings_for
from tools.sim.hardware.cluster import ClusterDescription

CLUSTER = ClusterDescription(racks=10, trays_per_rack=18, seed="grpc-test")


@pytest.fixture
async def seeded(store: Store) -> list[pb.Node]:
    records = cluster_records(CLUSTER)
    await put_nodes(store, records)
    return records


async def test_place_reserve_capacity_release_roundtrip(
    etcd_config: EtcdConfig, store: Store, seeded
) -> None:
    async with running_advisor(settings_for(etcd_config)) as adv:
        channel = adv.channel()
        try:
            stub = adv.stub(channel)
            before = await stub.get_capacity(pp.GetCapacityRequest())
            assert before.total_nodes == 180 and before.free_nodes == 180 and len(before.cliques) == 10

            dry = await stub.place(pp.PlaceRequest(num_nodes=8, dry_run=True, reserve=True))
            assert dry.feasible and not dry.reservation_id
            assert len(dry.placements) == 1 and len(dry.placements[0].node_names) == 8
            assert dry.policy == pp.Policy.BEST_FIT and dry.score > 0
            assert (await stub.get_capacity(pp.GetCapacityRequest())).free_nodes == 180

            placed = await stub.place(
                pp.PlaceRequest(num_nodes=8, reserve=True, domain_uid="dom-a", reservation_ttl_seconds=30)
            )
            assert placed.feasible and placed.reservation_id
            nodes = list(placed.placements[0].node_names)
            after = await stub.get_capacity(pp.GetCapacityRequest())
            assert after.free_nodes == 172 and after.reserved_nodes == 8
            assert after.fragmentation > 0 and placed.fragmentation_after > placed.fragmentation_before == 0

            # The reservation is in the store, with a guard per node, on a lease.
            record = await store.get(store.keys.reservation(placed.reservation_id), pb.Reservation)
            assert record is not None and record.lease and sorted(record.value.node_names) == sorted(nodes)
            guards, _ = await store.list(store.keys.node_reservations(), pb.Reservation)
            assert sorted(g.key.rsplit("/", 1)[1] for g in guards) == sorted(nodes)

            # Best fit puts the next small job into the same, already broken clique.
            second = await stub.place(pp.PlaceRequest(num_nodes=4, dry_run=True))
            assert second.placements[0].clique_id == placed.placements[0].clique_id

            released = await stub.release(pp.ReleaseRequest(reservation_id=placed.reservation_id))
            assert released.released and sorted(released.node_names) == sorted(nodes)
            assert (await stub.get_capacity(pp.GetCapacityRequest())).free_nodes == 180
            assert not (await stub.release(pp.ReleaseRequest(reservation_id=placed.reservation_id))).released
            guards, _ = await store.list(store.keys.node_reservations(), pb.Reservation)
            assert guards == []
        finally:
            channel.close()


async def test_explicit_reserve_conflicts_and_expiry(etcd_config: EtcdConfig, seeded) -> None:
    async with running_advisor(settings_for(etcd_config)) as adv:
        channel = adv.channel()
        try:
            stub = adv.stub(channel)
            names = [seeded[0].name, seeded[1].name]
            first = await stub.reserve(
                pp.ReserveRequest(node_names=names, domain_uid="d1", ttl_seconds=1, reservation_id="fixed-1")
            )
            assert first.reservation.id == "fixed-1" and first.reservation.node_names == names
            with pytest.raises(GRPCError) as conflict:
                await stub.reserve(pp.ReserveRequest(node_names=[names[1], seeded[2].name], ttl_seconds=5))
            assert conflict.value.status == Status.ABORTED and names[1] in (conflict.value.message or "")
            with pytest.raises(GRPCError) as exists:
                await stub.reserve(pp.ReserveRequest(node_names=[seeded[3].name], reservation_id="fixed-1"))
            assert exists.value.status == Status.ALREADY_EXISTS
            # The TTL runs out: the nodes are offered again.
            fleet = adv.service.fleet
            assert await wait_until(fleet, lambda: all(fleet.is_free(n) for n in names), 6.0)
            again = await stub.reserve(pp.ReserveRequest(node_names=names, ttl_seconds=5))
            assert again.reservation.node_names == names
        finally:
            channel.close()


BAD_REQUESTS = [
    (pp.PlaceRequest(num_nodes=0), "num_nodes"),
    (pp.PlaceRequest(num_nodes=-3), "num_nodes"),
    (pp.PlaceRequest(num_nodes=181), "num_nodes"),
    (pp.PlaceRequest(num_nodes=2, node_selector={"clique": "no-such-clique.7"}), 'node_selector["clique"]'),
    (pp.PlaceRequest(num_nodes=2, node_selector={"colour": "blue"}), 'node_selector["colour"]'),
    (pp.PlaceRequest(num_nodes=2, node_selector={"name": "rack99-tray0"}), 'node_selector["name"]'),
    (pp.PlaceRequest(num_nodes=10, mode=pp.PlacementMode.ALLOW_SPLIT, segment_size=4), "segment_size"),
    (pp.PlaceRequest(num_nodes=4, segment_size=2), "segment_size"),
    (pp.PlaceRequest(num_nodes=2, gpus_per_node=5), "gpus_per_node"),
    (pp.PlaceRequest(num_nodes=2, reservation_ttl_seconds=-1), "reservation_ttl_seconds"),
    (pp.PlaceRequest(num_nodes=2, domain_uid="a/b"), "domain_uid"),
]


async def test_bad_input_is_invalid_argument_naming_the_field_and_the_server_keeps_serving(
    etcd_config: EtcdConfig, seeded
) -> None:
    async with running_advisor(settings_for(etcd_config)) as adv:
        channel = adv.channel()
        try:
            stub = adv.stub(channel)
            for request, field in BAD_REQUESTS:
                with pytest.raises(GRPCError) as err:
                    await stub.place(request)
                assert err.value.status == Status.INVALID_ARGUMENT, (request, err.value)
                assert (err.value.message or "").startswith(field), (field, err.value.message)
            # An enum value this server does not know, sent as raw bytes.
            raw = bytes(pp.PlaceRequest(num_nodes=2)) + bytes([0x18, 99])  # field 3 (mode) = 99
            with pytest.raises(GRPCError) as err:
                await stub.place(pp.PlaceRequest().parse(raw))
            assert err.value.status == Status.INVALID_ARGUMENT and (err.value.message or "").startswith(
                "mode"
            )
            with pytest.raises(GRPCError) as err:
                await stub.explain(pp.ExplainRequest(request=pp.PlaceRequest(num_nodes=0)))
            assert (err.value.message or "").startswith("request.num_nodes")
            with pytest.raises(GRPCError) as err:
                await stub.reserve(pp.ReserveRequest(node_names=["nobody"]))
            assert err.value.status == Status.INVALID_ARGUMENT and "node_names[0]" in (
                err.value.message or ""
            )
            with pytest.raises(GRPCError) as err:
                await stub.get_capacity(pp.GetCapacityRequest(node_selector={"rack": "nowhere"}))
            assert 'node_selector["rack"]' in (err.value.message or "")
            # Still serving, on the same connection.
            ok = await stub.place(pp.PlaceRequest(num_nodes=18))
            assert ok.feasible
        finally:
            channel.close()


async def test_infeasible_requests_explain_why(etcd_config: EtcdConfig, store: Store, seeded) -> None:
    async with running_advisor(settings_for(etcd_config)) as adv:
        channel = adv.channel()
        try:
            stub = adv.stub(channel)
            too_big = await stub.place(pp.PlaceRequest(num_nodes=19))
            assert not too_big.feasible and too_big.reason == pp.Reason.NO_SINGLE_CLIQUE_FIT
            split = await stub.place(
                pp.PlaceRequest(num_nodes=36, mode=pp.PlacementMode.ALLOW_SPLIT, segment_size=18)
            )
            assert split.feasible and [len(s.node_names) for s in split.placements] == [18, 18]
            assert len({s.clique_id for s in split.placements}) == 2
            # Break every clique: 10 busy nodes each, so 8 free everywhere (80 free in total).
            reservations = []
            for rack in range(10):
                names = [f"rack{rack}-tray{t}" for t in range(10)]
                reply = await stub.reserve(pp.ReserveRequest(node_names=names, ttl_seconds=60))
                reservations.append(reply.reservation.id)
            fragmented = await stub.place(pp.PlaceRequest(num_nodes=9))
            assert fragmented.reason == pp.Reason.FRAGMENTED and "at most 8" in fragmented.message
            assert fragmented.largest_free_block_before == 8
            preferred = await stub.place(
                pp.PlaceRequest(num_nodes=9, mode=pp.PlacementMode.PREFER_SINGLE_CLIQUE)
            )
            assert preferred.feasible and len(preferred.placements) == 2
            no_room = await stub.place(
                pp.PlaceRequest(num_nodes=81, mode=pp.PlacementMode.PREFER_SINGLE_CLIQUE)
            )
            assert no_room.reason == pp.Reason.NO_CAPACITY

            explained = await stub.explain(
                pp.ExplainRequest(request=pp.PlaceRequest(num_nodes=6), max_alternatives=4)
            )
            assert explained.decision.feasible
            assert explained.alternatives[0].chosen
            assert 1 <= len(explained.alternatives) <= 4
            scores = [a.score for a in explained.alternatives[1:]]
            assert scores == sorted(scores, reverse=True)
        finally:
            channel.close()


async def test_watch_capacity_streams_changes(etcd_config: EtcdConfig, seeded) -> None:
    async with running_advisor(settings_for(etcd_config)) as adv:
        channel = adv.channel()
        try:
            stub = adv.stub(channel)
            stream = stub.watch_capacity(pp.WatchCapacityRequest(min_interval_ms=20))
            first = await asyncio.wait_for(stream.__anext__(), 5.0)
            assert first.free_nodes == 180
            await stub.place(pp.PlaceRequest(num_nodes=5, reserve=True))
            later = await asyncio.wait_for(stream.__anext__(), 5.0)
            while later.free_nodes != 175:
                later = await asyncio.wait_for(stream.__anext__(), 5.0)
            assert later.generation > first.generation
            await stream.aclose()
        finally:
            channel.close()


@pytest.mark.slow
async def test_fifty_clients_on_two_advisors_never_share_a_node(
    etcd_config: EtcdConfig, store: Store
) -> None:
    records = cluster_records(ClusterDescription(racks=56, seed="race"))  # 1008 nodes
    await put_nodes(store, records)
    rng = random.Random(50)
    sizes = [rng.choice([1, 2, 4, 8, 9, 16, 18]) for _ in range(50)]
    async with (
        running_advisor(settings_for(etcd_config)) as one,
        running_advisor(settings_for(etcd_config)) as two,
    ):
        results: list[pp.PlaceResponse] = []

        async def client(i: int) -> None:
            server = one if i % 2 else two
            channel = server.channel()
            try:
                reply = await server.stub(channel).place(
                    pp.PlaceRequest(
                        num_nodes=sizes[i], reserve=True, domain_uid=f"job-{i}", reservation_ttl_seconds=60
                    )
                )
                results.append(reply)
            finally:
                channel.close()

        await asyncio.gather(*(client(i) for i in range(50)))
        assert all(r.feasible and r.reservation_id for r in results)
        handed_out = [n for r in results for s in r.placements for n in s.node_names]
        assert len(handed_out) == sum(sizes)
        assert len(handed_out) == len(set(handed_out)), "two clients received the same node"
        assert all(len(r.placements) == 1 for r in results), "a job left its clique"
        # The store agrees: one guard per handed-out node, each naming the reservation that got it.
        guards, _ = await store.list(store.keys.node_reservations(), pb.Reservation)
        owner = {g.key.rsplit("/", 1)[1]: g.value.id for g in guards}
        for reply in results:
            for node in reply.placements[0].node_names:
                assert owner[node] == reply.reservation_id
        # Both advisors started from the same view, so they did collide, and the store arbitrated.
        conflicts = sum(
            adv.service.metrics.registry.get_sample_value(
                "cd_advisor_reservations_total", {"outcome": "conflict"}
            )
            or 0
            for adv in (one, two)
        )
        assert conflicts > 0


async def test_place_stream_answers_in_order_and_ends_on_bad_input(etcd_config: EtcdConfig, seeded) -> None:
    async with running_advisor(settings_for(etcd_config)) as adv:
        channel = adv.channel()
        try:
            stub = adv.stub(channel)
            sizes = [1, 18, 5, 9, 2, 17, 4, 36]
            requests = [
                pp.PlaceRequest(
                    num_nodes=n,
                    dry_run=True,
                    mode=pp.PlacementMode.PREFER_SINGLE_CLIQUE,
                )
                for n in sizes
            ]
            replies = [r async for r in stub.place_stream(requests)]
            assert [sum(len(s.node_names) for s in r.placements) for r in replies] == sizes
            assert all(r.feasible for r in replies)

            bad = [pp.PlaceRequest(num_nodes=2), pp.PlaceRequest(num_nodes=0), pp.PlaceRequest(num_nodes=3)]
            received = []
            with pytest.raises(GRPCError) as err:
                async for reply in stub.place_stream(bad):
                    received.append(reply)
            assert err.value.status == Status.INVALID_ARGUMENT
            assert (err.value.message or "").startswith("num_nodes")
            assert len(received) == 1
            # A new stream works.
            again = [r async for r in stub.place_stream([pp.PlaceRequest(num_nodes=4)])]
            assert again[0].feasible
        finally:
            channel.close()
