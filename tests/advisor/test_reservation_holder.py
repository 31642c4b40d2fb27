"""Reservations belong to their holder: another client's Release is refused and changes nothing.

Over gRPC against a real etcd: without TLS the caller is the holder its request names; with
mutual TLS it is the client certificate's name, whatever the request says. The extender's
reservation ids cannot be guessed from the domain uid.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from libs.gen.computedomain.placement import v1 as pp
from libs.gen.computedomain.state import v1 as pb
from libs.state.config import EtcdConfig
from libs.state.store import Store
from services.advisor.advisor import Advisor
from services.advisor.domain_placement import EXTENDER_HOLDER_PREFIX, DomainPlacer
from services.advisor.fleet_index import FleetIndex
from services.advisor.reservation_ids import ExtenderIds
from services.advisor.reservations import NotHolder, delete_reservation, write_reservation
from tests.advisor.fleet import cluster_records, put_nodes
from tests.advisor.harness import running_advisor, settings_for
from tests.advisor.test_advisor_auth import Pki, secured
from tools.controlplane.pki import issue_from_ca
from tools.sim.hardware.cluster import ClusterDescription

CLUSTER = ClusterDescription(racks=2, trays_per_rack=18, seed="holder-test")


@pytest.fixture
async def seeded(store: Store) -> list[pb.Node]:
    records = cluster_records(CLUSTER)
    await put_nodes(store, records)
    return records


async def _state(store: Store, reservation_id: str) -> tuple[int, dict[str, int]]:
    """The record's revision and each guard's: what a refused Release must leave as it was."""
    record = await store.get(store.keys.reservation(reservation_id), pb.Reservation)
    assert record is not None, f"reservation {reservation_id} is gone"
    guards, _ = await store.list(store.keys.node_reservations(), pb.Reservation)
    return record.mod_revision, {g.key: g.mod_revision for g in guards if g.value.id == reservation_id}


async def _release(channel: Channel, reservation_id: str, holder: str = "") -> pp.ReleaseResponse:
    stub = pp.PlacementAdvisorStub(channel, timeout=10)
    return await stub.release(pp.ReleaseRequest(reservation_id=reservation_id, holder=holder))


async def test_another_holders_release_is_permission_denied_and_changes_nothing(
    etcd_config: EtcdConfig, store: Store, seeded: list[pb.Node]
) -> None:
    async with running_advisor(settings_for(etcd_config)) as advisor:
        channel = advisor.channel()
        try:
            stub = advisor.stub(channel)
            placed = await stub.place(pp.PlaceRequest(num_nodes=6, reserve=True, holder="team-a"))
            assert placed.feasible and placed.reservation_id
            before = await _state(store, placed.reservation_id)
            assert len(before[1]) == 6
            capacity = (await stub.get_capacity(pp.GetCapacityRequest())).reserved_nodes

            for intruder in ("team-b", ""):  # another name, and none (the advisor's default holder)
                with pytest.raises(GRPCError) as refused:
                    await _release(channel, placed.reservation_id, intruder)
                assert refused.value.status == Status.PERMISSION_DENIED
                assert placed.reservation_id in str(refused.value.message)
                assert await _state(store, placed.reservation_id) == before
                assert (await stub.get_capacity(pp.GetCapacityRequest())).reserved_nodes == capacity == 6

            # Nor can another client take the id over (there is no renewal: a reservation lives
            # for its TTL); its Reserve under that id is refused and changes nothing either.
            free = [r.name for r in seeded if r.name not in placed.placements[0].node_names][:2]
            with pytest.raises(GRPCError) as taken:
                await stub.reserve(
                    pp.ReserveRequest(node_names=free, reservation_id=placed.reservation_id, holder="team-b")
                )
            assert taken.value.status == Status.ALREADY_EXISTS
            assert await _state(store, placed.reservation_id) == before

            released = await _release(channel, placed.reservation_id, "team-a")
            assert released.released
            assert sorted(released.node_names) == sorted(placed.placements[0].node_names)
            assert await store.get(store.keys.reservation(placed.reservation_id), pb.Reservation) is None
        finally:
            channel.close()


async def test_a_release_not_yet_in_the_advisors_view_checks_the_stored_holder(
    store: Store, seeded: list[pb.Node]
) -> None:
    """The store path (a record this advisor has not seen yet, e.g. written by another replica)."""
    nodes = [r.name for r in seeded[:3]]
    written = await write_reservation(store, nodes, ["c"] * 3, "dom", "team-a", 60, "r-stored")
    with pytest.raises(NotHolder):
        await delete_reservation(store, "r-stored", "team-b")
    record = await store.get(store.keys.reservation("r-stored"), pb.Reservation)
    assert record is not None and record.mod_revision == written.revision
    removed = await delete_reservation(store, "r-stored", "team-a")
    assert removed is not None and list(removed.node_names) == nodes


async def test_with_mutual_tls_the_certificate_not_the_declared_holder_may_release(
    etcd_config: EtcdConfig, seeded: list[pb.Node], tmp_path: Path
) -> None:
    pki = Pki(tmp_path)
    bob = issue_from_ca(pki.ca, tmp_path, "bob", "team-bob")

    def channel(context: ssl.SSLContext, port: int) -> Channel:
        return Channel("127.0.0.1", port, ssl=context)

    async with running_advisor(secured(etcd_config, pki)) as advisor:
        as_alice = channel(pki.client_context(pki.alice), advisor.grpc_port)
        as_bob = channel(pki.client_context(bob), advisor.grpc_port)
        try:
            placed = await pp.PlacementAdvisorStub(as_alice, timeout=10).place(
                pp.PlaceRequest(num_nodes=4, reserve=True)
            )
            assert placed.reservation_id
            store = advisor.service.store
            before = await _state(store, placed.reservation_id)
            # Bob names Alice as the holder: his certificate says otherwise.
            with pytest.raises(GRPCError) as refused:
                await _release(as_bob, placed.reservation_id, "team-alice")
            assert refused.value.status == Status.PERMISSION_DENIED
            assert "team-bob" in str(refused.value.message)
            assert await _state(store, placed.reservation_id) == before
            # Alice may, whatever holder her request declares.
            assert (await _release(as_alice, placed.reservation_id, "whoever")).released
        finally:
            as_alice.close()
            as_bob.close()


def test_extender_ids_are_unguessable_shared_by_key_and_never_forged() -> None:
    key = bytes(range(32))
    ids, replica, stranger = ExtenderIds(key), ExtenderIds(key), ExtenderIds()
    rid = ids.make("uid-1", 0)
    assert rid.startswith("cd-uid-1-0-") and rid != "cd-uid-1-0"
    assert len(rid.removeprefix("cd-uid-1-0-")) == 32  # 128 bits
    assert replica.make("uid-1", 0) == rid, "replicas with the shared key agree on the id"
    assert stranger.make("uid-1", 0) != rid
    assert ids.make("uid-1", 1) != rid and ids.make("uid-2", 0) != rid
    assert ids.sequence_of("uid-1", rid) == 0
    # An id guessed from the uid, or with another key's tag, is not the extender's.
    for forged in ("cd-uid-1-0", stranger.make("uid-1", 0), rid[:-1] + ("0" if rid[-1] != "0" else "1")):
        assert ids.sequence_of("uid-1", forged) is None
    # Older untagged ids still count, so a new reservation never reuses their sequence.
    assert ids.next_sequence("uid-1", ["cd-uid-1-0", ids.make("uid-1", 3), "cd-uid-10-7"]) == 4


async def test_the_reaper_does_not_take_a_guessed_id_for_the_extenders(store: Store) -> None:
    placer = DomainPlacer(Advisor(FleetIndex(), store), holder=f"{EXTENDER_HOLDER_PREFIX}r1")
    guessed = pb.Reservation(id="cd-dom-0", domain_uid="dom", holder=f"{EXTENDER_HOLDER_PREFIX}r1")
    assert not placer.made_by_extender(guessed)
    real = pb.Reservation(
        id=placer.ids.make("dom", 0), domain_uid="dom", holder=f"{EXTENDER_HOLDER_PREFIX}r2"
    )
    assert placer.made_by_extender(real)
