"""Reservations in the store: a record plus one guard key per node, all on one TTL lease.

<prefix>reservations/<id>          Reservation (what, for whom, until when)
<prefix>nodereservations/<node>    Reservation naming only that node: the per-node guard

A reservation is written in transactions that require, for every node, that
neither its guard key nor its domain binding (nodebindings/<node>) exists. Two
advisors (or two requests of one advisor) racing for a node therefore cannot
both win: etcd serialises the transactions and the loser's compare fails.
A reservation of up to 63 nodes fits one transaction (2 compares per node and one
for the record stay below etcd's 128): it goes through the advisor's commit
batcher, which writes the reservations of concurrent decisions in one request
(nested transactions, one per reservation) on one lease per TTL and second. Its
lease is therefore shared, and such a reservation is removed by deleting its
record and guards in one transaction guarded by the record's revision (or, after
a failed request, by the record's existence), never by revoking the lease. A larger reservation is written in chunks on a lease of its own; a
failed chunk revokes that lease, which removes every key written so far, and
Release revokes it. Expiry removes the record and all guards at once either way.
(An advisor older than the batcher releases by revoking the lease: do not mix
the two in one deployment for longer than a rolling upgrade.)
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import aetcd.exceptions
import structlog

from libs.gen.computedomain.state import v1 as pb
from libs.runtime.errors import PermanentError, RetryableError
from libs.state.codec import encode_payload
from libs.state.proto_wire import bytes_field
from libs.state.store import TRANSIENT_ERRORS, Absent, Compare, Delete, Op, Present, Put, Store, Unchanged
from services.advisor.commit_batcher import CommitBatcher

log = structlog.get_logger(__name__)

# Per chunk: 2 compares per node + 1 for the record's key stays below etcd's 128.
NODES_PER_TXN = 63
MIN_TTL_S = 1


class ReservationConflict(RetryableError, RuntimeError):
    """Some nodes are reserved or bound already; `taken` maps each to who holds it."""

    def __init__(self, taken: dict[str, str]) -> None:
        shown = ", ".join(f"{n} ({why})" for n, why in sorted(taken.items())[:8])
        more = f" and {len(taken) - 8} more" if len(taken) > 8 else ""
        super().__init__(f"node(s) already taken: {shown}{more}")
        self.taken = taken


class ReservationExists(PermanentError, RuntimeError):
    """A reservation with this id exists already."""

    def __init__(self, reservation_id: str) -> None:
        super().__init__(f"reservation {reservation_id} exists already")
        self.reservation_id = reservation_id


class NotHolder(PermanentError, RuntimeError):
    """The caller of a Release is not the reservation's holder (nothing was changed)."""

    def __init__(self, reservation_id: str, caller: str) -> None:
        super().__init__(
            f"reservation {reservation_id} is not held by {caller!r}: only its holder may release it"
        )
        self.reservation_id = reservation_id


@dataclass(frozen=True, slots=True)
class Written:
    record: pb.Reservation
    revision: int
    lease: int


def new_reservation_id() -> str:
    return uuid.uuid4().hex


def guard_values(reservation_id: str, nodes: Sequence[str], domain_uid: str, holder: str) -> list[bytes]:
    """The stored guard of each node: a Reservation naming only that node, written by hand (the
    same bytes as encoding the message; one per reserved node, so on the hot path)."""
    head = bytes_field(1, reservation_id.encode()) if reservation_id else b""
    tail = (bytes_field(4, domain_uid.encode()) if domain_uid else b"") + (
        bytes_field(5, holder.encode()) if holder else b""
    )
    return [encode_payload(pb.Reservation, head + bytes_field(2, n.encode()) + tail) for n in nodes]


def fits_one_txn(nodes: Sequence[str]) -> bool:
    return len(nodes) <= NODES_PER_TXN


async def write_reservation(
    store: Store,
    nodes: Sequence[str],
    clique_ids: Sequence[str],
    domain_uid: str,
    holder: str,
    ttl_s: int,
    reservation_id: str | None = None,
    batcher: CommitBatcher | None = None,
) -> Written:
    """Reserve `nodes` atomically (all or none); ReservationConflict / ReservationExists otherwise.

    With a batcher, a reservation that fits one transaction is committed with those of other
    concurrent decisions."""
    if not nodes:
        raise ValueError("a reservation needs at least one node")
    if len(set(nodes)) != len(nodes):
        raise ValueError("a reservation names a node twice")
    rid = reservation_id or new_reservation_id()
    if batcher is not None and fits_one_txn(nodes):
        written = await _write_batched(store, batcher, rid, nodes, clique_ids, domain_uid, holder, ttl_s)
    else:
        written = await _write_chunked(store, rid, nodes, clique_ids, domain_uid, holder, ttl_s)
    # Counted in the advisor's metrics; at debug level each one (thousands a second under load).
    log.debug(
        "reservation written",
        reservation=rid,
        cd_uid=domain_uid or None,
        nodes=len(nodes),
        cliques=len(set(clique_ids)),
        ttl_s=ttl_s,
        holder=holder,
    )
    return written


async def _write_batched(
    store: Store,
    batcher: CommitBatcher,
    rid: str,
    nodes: Sequence[str],
    clique_ids: Sequence[str],
    domain_uid: str,
    holder: str,
    ttl_s: int,
) -> Written:
    keys = store.keys
    record_key = keys.reservation(rid)
    ttl = max(ttl_s, MIN_TTL_S)
    guards = [keys.node_reservation(n) for n in nodes]
    compares: list[Compare] = [Absent(g) for g in guards]
    compares.extend(Absent(keys.node_binding(n)) for n in nodes)
    compares.append(Absent(record_key))
    values = guard_values(rid, nodes, domain_uid, holder)
    records: list[pb.Reservation] = []

    def build(lease: int, created_unix_ms: int) -> list[Op]:
        record = pb.Reservation(
            id=rid,
            node_names=list(nodes),
            clique_ids=list(clique_ids),
            domain_uid=domain_uid,
            holder=holder,
            created_unix_ms=created_unix_ms,
            ttl_seconds=ttl,
        )
        records.append(record)
        ops: list[Op] = [Put(g, v, lease) for g, v in zip(guards, values, strict=True)]
        ops.append(Put(record_key, record, lease))
        return ops

    size = sum(len(g) + len(v) for g, v in zip(guards, values, strict=True)) + 64 * len(nodes) + 256
    future = batcher.submit(
        compares, build, [*guards, record_key], ttl, size, undo=lambda: removal(store, rid, nodes, None)
    )
    try:
        committed = await asyncio.shield(future)
    except asyncio.CancelledError:
        # The caller is gone: a reservation written anyway is removed again (its TTL is the backstop).
        if not batcher.withdraw(future):
            batcher.undo_if_written(future, lambda c: _remove_written(store, rid, list(nodes), c.revision))
        raise
    if not committed.succeeded:
        if await store.get(record_key, pb.Reservation) is not None:
            raise ReservationExists(rid)
        raise ReservationConflict(await who_holds(store, nodes))
    return Written(records[-1], committed.revision, committed.lease)


async def _remove_written(store: Store, rid: str, nodes: list[str], revision: int) -> None:
    try:
        await remove_in_one_txn(store, rid, nodes, revision)
    except Exception as exc:
        log.warning("abandoned reservation not removed; it expires with TTL", reservation=rid, error=str(exc))


def removal(
    store: Store, rid: str, nodes: Sequence[str], revision: int | None
) -> tuple[list[Compare], list[Delete]]:
    """The transaction removing a reservation of one transaction's size: its record and guards,
    if the record is still the one written at `revision` (None: if any record of that id exists).
    Its guards are then its own: a guard is only ever created with its record and removed with it."""
    keys = store.keys
    record_key = keys.reservation(rid)
    deletes = [Delete(record_key), *(Delete(keys.node_reservation(n)) for n in nodes)]
    guard = Present(record_key) if revision is None else Unchanged(record_key, revision)
    return [guard], deletes


async def remove_in_one_txn(
    store: Store, rid: str, nodes: Sequence[str], revision: int, batcher: CommitBatcher | None = None
) -> int | None:
    """Remove the reservation written at `revision` (`removal`); the revision of the removal, or
    None when the record is not that one any more."""
    compares, ops = removal(store, rid, nodes, revision)
    if batcher is None:
        result = await store.txn(compares, ops)
        return result.revision if result.succeeded else None
    keys = [op.key for op in ops]
    committed = await batcher.submit(compares, lambda _lease, _ms: ops, keys, 0, 64 * len(ops))
    return committed.revision if committed.succeeded else None


async def remove_if_unchanged(
    store: Store, rid: str, nodes: Sequence[str], revision: int, batcher: CommitBatcher | None = None
) -> int | None:
    """Remove the reservation written at `revision`, whatever its size: the revision of the
    removal (0 when it was removed by revoking its lease, whose answer names no revision: the
    watch shows it), or None when the record is gone or not that one any more (another writer
    released it, or wrote a new one under the id: that one stays). A reservation of more than one
    transaction's nodes has a lease of its own, so revoking it removes that reservation only."""
    if fits_one_txn(nodes):
        return await remove_in_one_txn(store, rid, nodes, revision, batcher)
    current = await store.get(store.keys.reservation(rid), pb.Reservation)
    if current is None or current.mod_revision != revision or not current.lease:
        return None
    try:
        await store.client.revoke_lease(current.lease)
    except TRANSIENT_ERRORS:
        raise
    except aetcd.exceptions.ClientError as exc:
        # etcd's "requested lease not found": another writer revoked it, or it expired.
        log.info("reservation lease already gone", reservation=rid, lease=current.lease, error=str(exc))
        return None
    return 0


async def _write_chunked(
    store: Store,
    rid: str,
    nodes: Sequence[str],
    clique_ids: Sequence[str],
    domain_uid: str,
    holder: str,
    ttl_s: int,
) -> Written:
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


async def delete_reservation(store: Store, reservation_id: str, holder: str) -> pb.Reservation | None:
    """Remove a reservation of `holder` and its guards; the record that was removed, or None if
    none existed. NotHolder (nothing removed) when another holder's: the removal is guarded by the
    revision of the record whose holder was checked."""
    for _ in range(3):
        current = await store.get(store.keys.reservation(reservation_id), pb.Reservation)
        if current is None:
            return None
        if current.value.holder != holder:
            raise NotHolder(reservation_id, holder)
        nodes = current.value.node_names
        if not fits_one_txn(nodes):
            break
        # Its lease may be shared with other reservations: remove its keys, not the lease.
        if await remove_in_one_txn(store, reservation_id, nodes, current.mod_revision) is not None:
            log.info("reservation released", reservation=reservation_id, nodes=len(nodes))
            return current.value
    else:
        raise RuntimeError(f"reservation {reservation_id} kept changing while it was being released; retry")
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
