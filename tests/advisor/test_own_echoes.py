"""The reservations watch's echoes of the advisor's own writes: held back undecoded while the
write is in flight, dropped when the writer applied the same record, applied when it did not.
In memory (the inventory's rules) and against a real etcd, with the write's answer held back
until the watch's echo has come (as on a busy advisor) or lost after etcd applied it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

import libs.state.watch
from libs.gen.computedomain.state import v1 as pb
from libs.state.codec import encode
from libs.state.store import Compare, Op, Store
from libs.state.watch import WatchEvent
from services.advisor.advisor import Advisor
from services.advisor.fleet_index import FleetIndex
from services.advisor.model import Mode, PlacementRequest
from services.advisor.own_echoes import OwnEchoes
from tests.advisor.fleet import cluster_records, filled_fleet
from tests.advisor.harness import advisor_on_store
from tools.sim.hardware.cluster import ClusterDescription

CLUSTER = ClusterDescription(racks=4, trays_per_rack=18, seed="own-echoes")
KEY = "/cd/reservations/r1"


def _inventory() -> FleetIndex:
    return filled_fleet(cluster_records(CLUSTER))


def _record(nodes: Sequence[str]) -> pb.Reservation:
    return pb.Reservation(id="r1", node_names=list(nodes), domain_uid="d", holder="h", ttl_seconds=60)


def test_an_echo_of_a_write_in_flight_is_held_and_dropped_once_the_writer_applied_it() -> None:
    fleet = _inventory()
    nodes = sorted(fleet.nodes)[:3]
    fleet.begin_write("r1")
    assert fleet.skips_reservation_put(KEY, 7, encode(_record(nodes)))
    assert "r1" not in fleet.reservations  # held, not applied
    written = _record(nodes)
    fleet.apply_reservation("r1", written, 7)
    fleet.end_write("r1", 7)
    assert fleet.reservations["r1"] is written
    assert fleet.own_echoes.handed_back == 0 and len(fleet.own_echoes) == 0
    # Written and applied: a later echo of the same revision is skipped as before.
    assert fleet.skips_reservation_put(KEY, 7, b"")


def test_an_echo_of_a_write_whose_answer_was_lost_is_applied_when_the_write_ends() -> None:
    fleet = _inventory()
    nodes = sorted(fleet.nodes)[:3]
    fleet.begin_write("r1")
    assert fleet.skips_reservation_put(KEY, 9, encode(_record(nodes)))
    fleet.end_write("r1", 0)  # the writer applied nothing: etcd did
    assert list(fleet.reservations["r1"].node_names) == nodes
    assert all(fleet.reserved_by[n] == "r1" for n in nodes)
    assert fleet.own_echoes.handed_back == 1


def test_a_delete_seen_while_a_put_is_held_supersedes_it() -> None:
    fleet = _inventory()
    nodes = sorted(fleet.nodes)[:3]
    fleet.begin_write("r1")
    assert fleet.skips_reservation_put(KEY, 9, encode(_record(nodes)))
    fleet.apply_reservation_event(WatchEvent("delete", KEY, None, 10))
    fleet.end_write("r1", 0)
    assert "r1" not in fleet.reservations and not fleet.reserved_by


def test_puts_of_ids_nobody_here_is_writing_go_through() -> None:
    fleet = _inventory()
    assert not fleet.skips_reservation_put(KEY, 3, b"anything")
    echoes = OwnEchoes()
    echoes.begin("r1")
    assert (
        echoes.hold("r1", KEY, 4, b"a")
        and echoes.hold("r1", KEY, 6, b"b")
        and echoes.hold("r1", KEY, 5, b"c")
    )
    held = echoes.end("r1", 4)
    assert held is not None and (held.revision, held.value) == (6, b"b")  # the newest, not the writer's
    assert echoes.end("r1", 0) is None  # ended once


class _AnswerAfterEcho:
    """The store as the commit batcher sees it: etcd applies the transaction, but its answer is
    handed over only once the watch's echo of it has been held, as on a busy advisor. With
    `lose_answer` the answer never comes (the connection broke after etcd applied it), and etcd
    stays out of reach from then on: neither the batch's undo nor a lease revocation gets
    through, so the record stays until its TTL."""

    def __init__(self, store: Store, echoes: OwnEchoes, lose_answer: bool) -> None:
        self._store = store
        self._lose_answer = lose_answer
        self._reachable = True
        self._echo_held = asyncio.Event()
        hold = echoes.hold

        def hold_and_tell(reservation_id: str, key: str, revision: int, value: bytes) -> bool:
            held = hold(reservation_id, key, revision, value)
            if held:
                self._echo_held.set()
            return held

        echoes.hold = hold_and_tell  # type: ignore[method-assign]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def txn_each(self, txns: Sequence[tuple[Sequence[Compare], Sequence[Op]]]) -> Any:
        if not self._reachable:
            raise ConnectionError("etcd unreachable")
        self._echo_held.clear()
        answer = await self._store.txn_each(txns)
        await asyncio.wait_for(self._echo_held.wait(), 10)
        if self._lose_answer:
            self._reachable = False
            raise ConnectionError("connection to etcd lost before the answer")
        return answer

    async def revoke_lease(self, lease: int) -> None:
        raise ConnectionError("etcd unreachable")


@pytest.fixture
async def advisor(store: Store) -> AsyncIterator[Advisor]:
    async with advisor_on_store(store, cluster_records(CLUSTER)) as adv:
        yield adv


def _reserve(num_nodes: int) -> PlacementRequest:
    return PlacementRequest(
        num_nodes=num_nodes, mode=Mode.PREFER_SINGLE_CLIQUE, reserve=True, reservation_ttl_s=60
    )


async def test_an_echo_that_overtakes_the_answer_is_never_decoded(
    advisor: Advisor, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoded: list[str] = []
    real_decode = libs.state.watch.decode

    def counting_decode(data: bytes, cls: type, key: str = "?") -> Any:
        decoded.append(key)
        return real_decode(data, cls, key)

    monkeypatch.setattr(libs.state.watch, "decode", counting_decode)
    echoes = advisor.fleet.own_echoes
    assert advisor.batcher is not None
    advisor.batcher.store = _AnswerAfterEcho(store, echoes, lose_answer=False)  # type: ignore[assignment]

    decision = await advisor.place(_reserve(4))

    assert decision.reservation is not None
    rid = decision.reservation.id
    assert echoes.held == 1 and echoes.handed_back == 0 and len(echoes) == 0
    assert not [k for k in decoded if k.endswith(f"/reservations/{rid}")]
    record = advisor.fleet.reservations[rid]
    assert sorted(record.node_names) == sorted(decision.node_names)


async def test_a_write_applied_by_etcd_whose_answer_was_lost_still_shows_in_the_inventory(
    advisor: Advisor, store: Store
) -> None:
    """Had the held echo been dropped with the failed write, the advisor would offer these nodes
    again while etcd keeps them reserved for the TTL."""
    echoes = advisor.fleet.own_echoes
    assert advisor.batcher is not None
    advisor.batcher.store = _AnswerAfterEcho(store, echoes, lose_answer=True)  # type: ignore[assignment]

    with pytest.raises(ConnectionError):
        await advisor.place(_reserve(4))

    # The batch's undo (which cannot reach etcd either) has ended before the record is checked.
    assert not await advisor.batcher.drained(10), "the failed batch's undo did not end"
    stored, _ = await store.list(store.keys.reservations(), pb.Reservation)
    assert len(stored) == 1  # etcd applied it, and nothing could remove it
    rid = stored[0].value.id
    assert echoes.handed_back == 1
    assert sorted(advisor.fleet.reservations[rid].node_names) == sorted(stored[0].value.node_names)
    assert all(advisor.fleet.reserved_by[n] == rid for n in stored[0].value.node_names)
