"""Reservations in the store: a record plus one guard key per node, all on one TTL lease.

<prefix>reservations/<id>          Reservation (what, for whom, until when)
<prefix>nodereservations/<node>    Reservation naming only that node: the per-node guard

A reservation is written in transactions that require, for every node, that
neither its guard key nor its domain binding (nodebindings/<node>) exists. Two
advisors (or two requests of one advisor) racing for a node therefore cannot
both win: etcd serialises the transactions and the loser's compare fails.
etcd caps a transaction at 128 operations and compares, so large reservations
are written in chunks; a failed chunk revokes the lease, which removes every
key written so far. The lease's expiry (or Release, which revokes it) removes
the record and all guards at once.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from libs.gen.computedomain.state import v1 as pb
from libs.state.store import Absent, Compare, Op, Put, Store

log = structlog.get_logger(__name__)

# Per chunk: 2 compares per node + 1 for the record's key stays below etcd's 128.
NODES_PER_TXN = 63
MIN_TTL_S = 1


class ReservationConflict(RuntimeError):
    """Some nodes are reserved or bound already; `taken` maps each to who holds it."""

    def __init__(self, taken: dict[str, str]) -> None:
        shown = ", ".join(f"{n} ({why})" for n, why in sorted(taken.items())[:8])
        more = f" and {len(taken) - 8} more" if len(taken) > 8 else ""
        super().__init__(f"node(s) already taken: {shown}{more}")
        self.taken = taken


class ReservationExists(RuntimeError):
    """A reservation with this id exists already."""

    def __init__(self, reservation_id: str) -> None:
        super().__init__(f"reservation {reservation_id} exists already")
        self.reservation_id = reservation_id


@dataclass(frozen=True, slots=True)
class Written:
    record: pb.Reservation
    revision: int
    lease: int


def new_reservation_id() -> str:
    return uuid.uuid4().hex


async def write_reservation(
    store: Store,
    nodes: Sequence[str],
    clique_ids: Sequence[str],
    domain_uid: str,
    holder: str,
    ttl_s: int,
    reservation_id: str | None = None,
) -> Written:
    """Reserve `nodes` atomically (all or none); ReservationConflict / ReservationExists otherwise."""
    if not nodes:
        raise ValueError("a reservation needs at least one node")
    if len(set(nodes)) != len(nodes):
        raise ValueError("a reservation names a node twice")
    rid = reservation_id or new_reservation_id()
    keys = store.keys
    record_key = keys.reservation(rid)
    record = pb.Reservation(
        id=rid,
        node_names=list(nodes),
        clique_ids=list(clique_ids),
        domain_uid=domain_uid,
        holder=holder,
        created_unix_ms=int(time.time() * 1000),
        ttl_seconds=max(ttl_s, MIN_TTL_S),
    )
    lease = await store.grant_lease(max(ttl_s, MIN_TTL_S))
    chunks = [list(nodes[i : i + NODES_PER_TXN]) for i in range(0, len(nodes), NODES_PER_TXN)]
    revision = 0
    try:
        for number, chunk in enumerate(chunks):
            compares: list[Compare] = []
            ops: list[Op] = []
            for node in chunk:
                gkey = store.keys.node_reservation(node)
                compares.append(Absent(gkey))
                compares.append(Absent(keys.node_binding(node)))
                ops.append(
                    Put(
                        gkey,
                        pb.Reservation(id=rid, node_names=[node], domain_uid=domain_uid, holder=holder),
                        lease,
                    )
                )
            if number == len(chunks) - 1:
                compares.append(Absent(record_key))
                ops.append(Put(record_key, record, lease))
            result = await store.txn(compares, ops)
            if not result.succeeded:
                await _revoke_quietly(store, lease)
                if number == len(chunks) - 1 and await store.get(record_key, pb.Reservation) is not None:
                    raise ReservationExists(rid)
                raise ReservationConflict(await who_holds(store, nodes))
            revision = result.revision
    except (ReservationConflict, ReservationExists):
        raise
    except BaseException:
        # Cancelled or the store failed mid-way: do not leave guards behind until the TTL.
        await asyncio.shield(_revoke_quietly(store, lease))
        raise
    log.info(
        "reservation written",
        reservation=rid,
        cd_uid=domain_uid or None,
        nodes=len(nodes),
        cliques=len(set(clique_ids)),
        ttl_s=ttl_s,
        holder=holder,
    )
    return Written(record, revision, lease)


async def who_holds(store: Store, nodes: Sequence[str]) -> dict[str, str]:
    """Which of `nodes` are reserved or bound, and by whom (one read per key, concurrently)."""
    keys = store.keys

    async def check(node: str) -> tuple[str, str | None]:
        guard, binding = await asyncio.gather(
            store.get(store.keys.node_reservation(node), pb.Reservation),
            store.get(keys.node_binding(node), pb.NodeBinding),
        )
        if binding is not None:
            return node, f"bound to domain {binding.value.domain_uid}"
        if guard is not None:
            return node, f"reserved by {guard.value.id}"
        return node, None

    results = await asyncio.gather(*(check(n) for n in nodes))
    return {node: why for node, why in results if why is not None}


async def delete_reservation(store: Store, reservation_id: str) -> pb.Reservation | None:
    """Remove a reservation and its guards; the record that was removed, or None if none existed."""
    current = await store.get(store.keys.reservation(reservation_id), pb.Reservation)
    if current is None:
        return None
    if current.lease:
        await store.revoke_lease(current.lease)
        if await store.get(store.keys.reservation(reservation_id), pb.Reservation) is None:
            log.info("reservation released", reservation=reservation_id, nodes=len(current.value.node_names))
            return current.value
    # Without a lease (or when the revoke failed), remove what belongs to this reservation.
    await store.delete(store.keys.reservation(reservation_id))
    for node in current.value.node_names:
        guard = await store.get(store.keys.node_reservation(node), pb.Reservation)
        if guard is not None and guard.value.id == reservation_id:
            await store.delete(store.keys.node_reservation(node))
    log.info("reservation released", reservation=reservation_id, nodes=len(current.value.node_names))
    return current.value


async def _revoke_quietly(store: Store, lease: int) -> None:
    try:
        await store.revoke_lease(lease)
    except Exception as exc:  # expiry will remove the keys anyway
        log.warning("lease revoke failed; keys expire with the TTL", lease=lease, error=str(exc))
