"""Domain membership: joining, leaving, losing and reviving nodes, with central index assignment.

Shared by the node agent (join on first prepare, leave on last unprepare), the
controller (node loss and return) and the tests. Each step is one etcd
transaction that compares what it read, so concurrent joins never hand out an
index twice and a node is never in two domains (invariants 1 and 2 of docs/state-model.md).
Upstream assigns indices client-side and races (#816, #1050); here the store
arbitrates.

A member's index never changes while the member exists: a LOST member keeps
its index and its `memberindex/` claim (its slot in every peer's nodes config
stays its own), and becomes ACTIVE again at that index when its node returns.
Only a release (`leave_domain`, the controller's ReleaseMember) frees an index.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass

import structlog

from libs.gen.computedomain.state import v1 as pb
from libs.runtime.backoff import Backoff
from libs.runtime.errors import PermanentError, RetryableError
from libs.state.codec import encode_payload
from libs.state.domain_record import DomainRecord
from libs.state.proto_wire import varint_field
from libs.state.store import (
    Absent,
    Compare,
    ConflictError,
    CreatedAt,
    Delete,
    FirstAbsent,
    Op,
    Put,
    RawKV,
    Read,
    Store,
    Unchanged,
    Versioned,
)

log = structlog.get_logger(__name__)

MAX_NODES_PER_IMEX_DOMAIN = 18
NON_FABRIC_INDEX = -1


class NodeBusy(RetryableError, RuntimeError):
    """The node is a member of another domain (retryable: it may leave soon)."""

    def __init__(self, node: str, other_domain: str) -> None:
        super().__init__(f"node {node} is busy: it is a member of domain {other_domain}")
        self.node = node
        self.other_domain = other_domain


class DomainUnavailable(RetryableError, RuntimeError):
    """The domain does not exist (yet, or any more) or is being deleted: no node may join it."""


class CliqueFull(RetryableError, RuntimeError):
    """Every index of the node's clique in this domain is taken."""


class IndexConflict(PermanentError, RuntimeError):
    """A member's own index claim names another node: the store broke invariant 2.

    Raised instead of moving the member to another index: its slot is what peers'
    daemons know it by, so a silent move would cut it off from a running job.
    """


def lowest_free_index(used: Iterable[int], limit: int) -> int | None:
    """The smallest index in [0, limit) not in `used`, or None when all are taken."""
    taken = set(used)
    for index in range(limit):
        if index not in taken:
            return index
    return None


@dataclass(frozen=True)
class JoinResult:
    member: pb.Member
    # False when the node already was an active member (idempotent repeat).
    joined_now: bool
    attempts: int


@dataclass(frozen=True)
class _JoinView:
    binding: Versioned[pb.NodeBinding] | None
    member: Versioned[pb.Member] | None
    used_indices: list[int]


def _join_reads(store: Store, domain_uid: str, node: pb.Node) -> list[Op]:
    keys = store.keys
    reads: list[Op] = [Read(keys.node_binding(node.name)), Read(keys.member(domain_uid, node.name))]
    if node.clique_id:
        reads.append(Read(keys.member_indices(domain_uid, node.clique_id), prefix=True))
    return reads


def _join_view(store: Store, reads: tuple[list[RawKV], ...]) -> _JoinView:
    # Strict: an undecodable binding or member is not absent; a join taking it so would only lose
    # every race against the key that is there. It fails at once, naming the key.
    binding = store.decode_kv(reads[0][0], pb.NodeBinding, strict=True) if reads[0] else None
    member = store.decode_kv(reads[1][0], pb.Member, strict=True) if reads[1] else None
    used: list[int] = []
    if len(reads) > 2:
        for kv in reads[2]:
            index = index_of_claim_key(kv.key)
            if index is not None:
                used.append(index)
    return _JoinView(binding, member, used)


def index_of_claim_key(key: str) -> int | None:
    """The index an index-claim key holds (its last segment), None for a foreign key.

    Read from the key, not the value: losers of a join race read the whole
    clique's claims on every attempt, and decoding each value dominated a herd.
    """
    tail = key.rpartition("/")[2]
    return int(tail) if tail.isdigit() else None


class _IndexedRecords:
    """The Member and IndexClaim a joiner writes, pre-serialised around their `index` field.

    A join offers etcd every free index at once (one nested transaction per index); building and
    serialising two betterproto messages per offered index would cost more than the join. The
    fields before and after `index` are serialised once; each index only splices its own field in,
    which gives the bytes betterproto would write for that message.
    """

    def __init__(self, member: pb.Member, claim: pb.IndexClaim) -> None:
        self.member = member
        self._member_head = bytes(
            pb.Member(domain_uid=member.domain_uid, node_name=member.node_name, clique_id=member.clique_id)
        )
        self._member_tail = bytes(
            pb.Member(
                state=member.state,
                ip_address=member.ip_address,
                joined_unix_ms=member.joined_unix_ms,
                namespace=member.namespace,
                mesh_mode=member.mesh_mode,
            )
        )
        self._claim_head = bytes(pb.IndexClaim(domain_uid=claim.domain_uid, clique_id=claim.clique_id))
        self._claim_tail = bytes(pb.IndexClaim(node_name=claim.node_name))

    def member_value(self, index: int) -> bytes:
        return encode_payload(pb.Member, self._member_head + varint_field(4, index) + self._member_tail)

    def claim_value(self, index: int) -> bytes:
        return encode_payload(pb.IndexClaim, self._claim_head + varint_field(3, index) + self._claim_tail)


async def _joinable_domain(store: Store, domain_uid: str, node: str) -> Versioned[DomainRecord]:
    return _joinable(await store.get(store.keys.domain(domain_uid), DomainRecord), domain_uid, node)


def _joinable(domain: Versioned[DomainRecord] | None, domain_uid: str, node: str) -> Versioned[DomainRecord]:
    if domain is None:
        raise DomainUnavailable(f"node {node} cannot join domain {domain_uid}: it does not exist")
    if domain.value.deleting:
        raise DomainUnavailable(f"node {node} cannot join domain {domain_uid}: it is being deleted")
    return domain


async def join_domain(
    store: Store,
    domain_uid: str,
    namespace: str,
    node: pb.Node,
    max_nodes_per_clique: int = MAX_NODES_PER_IMEX_DOMAIN,
    max_attempts: int = 400,
) -> JoinResult:
    """Make `node` an active member of the domain, assigning the lowest free index of its clique.

    One transaction guards the node's binding and member record; inside it, nested transactions
    offer the free indices in ascending order and etcd applies the first whose claim key is still
    absent. Concurrent joiners of one clique therefore each get the lowest index free at their
    commit, in one round trip, with no herd of retries on index 0. A joiner retries only when its
    own binding or member record changed, or every index it offered was taken meanwhile; the
    failure branch reads the state back, so a retry starts from fresh state.
    """
    keys = store.keys
    member_key = keys.member(domain_uid, node.name)
    binding_key = keys.node_binding(node.name)
    fabric = bool(node.clique_id)
    reads = _join_reads(store, domain_uid, node)
    # The domain is read once, with the first view, not on every attempt: the record carries the
    # status, a rack's worth of nodes.
    first = (await store.txn([], [*reads, Read(keys.domain(domain_uid))])).reads
    view = _join_view(store, first[:-1])
    domain = _joinable(
        store.decode_kv(first[-1][0], DomainRecord, strict=True) if first[-1] else None, domain_uid, node.name
    )
    backoff = Backoff(initial=0.001, cap=0.05, jitter=0.5)
    new_member = pb.Member(
        domain_uid=domain_uid,
        node_name=node.name,
        clique_id=node.clique_id,
        index=NON_FABRIC_INDEX,
        state=pb.MemberState.ACTIVE,
        ip_address=node.ip_address,
        joined_unix_ms=int(time.time() * 1000),
        namespace=namespace,
        mesh_mode=domain.value.mesh_mode,
    )
    binding_put = Put(binding_key, pb.NodeBinding(node_name=node.name, domain_uid=domain_uid))
    records = _IndexedRecords(new_member, pb.IndexClaim(domain_uid, node.clique_id, 0, node.name))
    for attempt in range(1, max_attempts + 1):
        binding, member = view.binding, view.member
        if binding is not None and binding.value.domain_uid != domain_uid:
            raise NodeBusy(node.name, binding.value.domain_uid)
        if member is not None and holds_index(member.value):
            current = member.value
            if current.state == pb.MemberState.ACTIVE and current.ip_address == (
                node.ip_address or current.ip_address
            ):
                return JoinResult(current, False, attempt)
            # Already a member, lost or at an old address: it keeps its index; only its state and
            # address change. Nothing here ever hands a member a second index.
            resumed = await _resume_membership(store, domain_uid, node, attempt, max_attempts)
            if resumed is not None:
                return resumed
            # Released meanwhile: join afresh.
            view = _join_view(store, (await store.txn([], reads)).reads)
            continue

        compares: list[Compare] = [
            Unchanged(binding_key, binding.mod_revision) if binding else Absent(binding_key),
            Unchanged(member_key, member.mod_revision) if member else Absent(member_key),
            # In the same transaction: the record's removal (or re-creation) meanwhile fails the join.
            # Not its mod revision: the controller rewrites the status all through a formation, and
            # every such write would fail a join. A deletion *request* racing the join lets it land
            # on a deleting domain, which teardown then waits out like any member.
            CreatedAt(domain.key, domain.create_revision),
        ]
        ops: list[Op]
        offered: list[int] = []
        if fabric:
            taken = set(view.used_indices)
            offered = [i for i in range(max_nodes_per_clique) if i not in taken]
            if not offered:
                raise CliqueFull(
                    f"clique {node.clique_id} of domain {domain_uid} already has "
                    f"{max_nodes_per_clique} members (maxNodesPerImexDomain)"
                )
            ops = [
                FirstAbsent(
                    tuple(
                        (
                            keys.member_index(domain_uid, node.clique_id, i),
                            (
                                Put(keys.member_index(domain_uid, node.clique_id, i), records.claim_value(i)),
                                Put(member_key, records.member_value(i)),
                                binding_put,
                            ),
                        )
                        for i in offered
                    )
                )
            ]
        else:
            ops = [Put(member_key, new_member), binding_put]
        result = await store.txn(compares, ops, failure=reads)
        if result.succeeded and (not fabric or result.chosen is not None):
            index = offered[result.chosen] if fabric and result.chosen is not None else NON_FABRIC_INDEX
            joined = pb.Member().parse(bytes(new_member))
            joined.index = index
            log.info(
                "node joined domain",
                cd_uid=domain_uid,
                node=node.name,
                clique=node.clique_id,
                index=index,
                attempts=attempt,
            )
            return JoinResult(joined, True, attempt)
        if not result.succeeded and attempt % 8 == 0:
            domain = await _joinable_domain(store, domain_uid, node.name)  # gone meanwhile?
        # Back off (jittered, capped) so that joiners racing on the same records spread out;
        # after a longer pause the state read back is stale, so read it again.
        delay = backoff.next_delay()
        await asyncio.sleep(delay)
        if not result.succeeded and delay < 0.005:
            view = _join_view(store, result.reads)
        else:
            view = _join_view(store, (await store.txn([], reads)).reads)
    raise ConflictError(f"join of {node.name} to domain {domain_uid} lost {max_attempts} races")


async def leave_domain(store: Store, domain_uid: str, node_name: str, max_attempts: int = 50) -> bool:
    """Remove the node's membership, its index and its binding; False if it was not a member."""
    keys = store.keys
    member_key = keys.member(domain_uid, node_name)
    binding_key = keys.node_binding(node_name)
    backoff = Backoff(initial=0.002, cap=0.1)
    for _ in range(max_attempts):
        member = await store.get(member_key, pb.Member)
        binding = await store.get(binding_key, pb.NodeBinding)
        ops: list[Op] = [Delete(member_key), Delete(keys.daemon(domain_uid, node_name))]
        compares: list[Compare] = [Unchanged(member_key, member.mod_revision if member else 0)]
        if binding is not None and binding.value.domain_uid == domain_uid:
            ops.append(Delete(binding_key))
            compares.append(Unchanged(binding_key, binding.mod_revision))
        if member is not None and member.value.index >= 0:
            ops.append(Delete(keys.member_index(domain_uid, member.value.clique_id, member.value.index)))
        if member is None and len(ops) == 2:
            return False
        if (await store.txn(compares, ops)).succeeded:
            log.info("node left domain", cd_uid=domain_uid, node=node_name)
            return member is not None
        await asyncio.sleep(backoff.next_delay())
    raise ConflictError(f"leave of {node_name} from domain {domain_uid} lost {max_attempts} races")


async def mark_member_lost(
    store: Store, domain_uid: str, node_name: str, extra_compares: Iterable[Compare] = ()
) -> bool:
    """The node is gone: the member becomes LOST and keeps everything else.

    Its index and `memberindex/` claim stay (its slot in the peers' nodes config is still
    its own, so nothing is reconfigured and it can take it up again), and so does its
    binding (the node cannot join another domain while this one still counts it). Returns
    False if the member was not active (nothing to do) or a concurrent write won.
    """
    keys = store.keys
    member_key = keys.member(domain_uid, node_name)
    member = await store.get(member_key, pb.Member)
    if member is None or member.value.state != pb.MemberState.ACTIVE:
        return False
    lost = pb.Member().parse(bytes(member.value))
    lost.state = pb.MemberState.LOST
    result = await store.txn(
        [Unchanged(member_key, member.mod_revision), *extra_compares], [Put(member_key, lost)]
    )
    if result.succeeded:
        log.warning(
            "member lost",
            cd_uid=domain_uid,
            node=node_name,
            clique=member.value.clique_id,
            index=member.value.index,
        )
    return result.succeeded


def holds_index(member: pb.Member) -> bool:
    """The member has the index it keeps for life: any non-fabric member, a fabric one at >= 0.

    A fabric member at -1 is a LOST member written before indices were kept; it takes a
    fresh index on its next join, like a newcomer.
    """
    return not member.clique_id or member.index >= 0


def _claim_guard(
    store: Store, domain_uid: str, member: pb.Member, claim: RawKV | None
) -> tuple[list[Compare], list[Op]]:
    """Compares and writes that keep the member's own index claim in place.

    The claim exists whenever the member does. Should it be missing, it is written again at
    the member's index, on the condition that the key is still absent: the member never moves
    to another index, and an index taken by someone else meanwhile fails the transaction.
    A claim naming another node is a broken invariant that no retry fixes: IndexConflict.
    """
    if not member.clique_id or member.index < 0:
        return [], []
    key = store.keys.member_index(domain_uid, member.clique_id, member.index)
    own = pb.IndexClaim(domain_uid, member.clique_id, member.index, member.node_name)
    if claim is None:
        log.warning(
            "member's index claim missing; restoring it at the same index",
            cd_uid=domain_uid,
            node=member.node_name,
            clique=member.clique_id,
            index=member.index,
        )
        return [Absent(key)], [Put(key, own)]
    held = store.decode_kv(claim, pb.IndexClaim)
    if held is not None and held.value.node_name != member.node_name:
        raise IndexConflict(
            f"index {member.index} of clique {member.clique_id} in domain {domain_uid} is claimed by "
            f"{held.value.node_name}, but member {member.node_name} holds it; not moving the member"
        )
    # An undecodable claim at the member's own index is rewritten (the member record says whose it is).
    return [Unchanged(key, claim.mod_revision)], ([] if held is not None else [Put(key, own)])


async def _read_for_resume(
    store: Store, domain_uid: str, node_name: str
) -> tuple[Versioned[pb.NodeBinding] | None, Versioned[pb.Member] | None, RawKV | None]:
    keys = store.keys
    first = await store.txn(
        [], [Read(keys.node_binding(node_name)), Read(keys.member(domain_uid, node_name))]
    )
    binding = store.decode_kv(first.reads[0][0], pb.NodeBinding) if first.reads[0] else None
    member = store.decode_kv(first.reads[1][0], pb.Member) if first.reads[1] else None
    claim: RawKV | None = None
    if member is not None and member.value.clique_id and member.value.index >= 0:
        key = keys.member_index(domain_uid, member.value.clique_id, member.value.index)
        # A second round trip (the key depends on the member); the writer compares both as read.
        second = await store.txn([], [Read(key)])
        claim = second.reads[0][0] if second.reads[0] else None
    return binding, member, claim


async def _resume_membership(
    store: Store, domain_uid: str, node: pb.Node, attempt: int, max_attempts: int
) -> JoinResult | None:
    """The node already is a member: ACTIVE at the same index, address from its node record.

    An active member with the right address is left alone (no write). A LOST member is made
    ACTIVE again in one transaction comparing the member, its binding and its index claim
    as read, so it never takes an index another member holds. None: the member is gone.
    """
    keys = store.keys
    member_key = keys.member(domain_uid, node.name)
    binding_key = keys.node_binding(node.name)
    backoff = Backoff(initial=0.002, cap=0.1)
    for tries in range(attempt, max_attempts + 1):
        binding, member, claim = await _read_for_resume(store, domain_uid, node.name)
        if binding is not None and binding.value.domain_uid != domain_uid:
            raise NodeBusy(node.name, binding.value.domain_uid)
        if member is None or not holds_index(member.value):
            return None  # released (or rewritten) meanwhile: the caller joins afresh
        current = member.value
        address = node.ip_address or current.ip_address
        if current.state == pb.MemberState.ACTIVE and current.ip_address == address:
            return JoinResult(current, False, tries)
        resumed = pb.Member().parse(bytes(current))
        resumed.state = pb.MemberState.ACTIVE
        resumed.ip_address = address
        if node.clique_id != current.clique_id:
            log.warning(
                "node's clique differs from its member's; keeping the member's clique and index",
                cd_uid=domain_uid,
                node=node.name,
                member_clique=current.clique_id,
                node_clique=node.clique_id,
            )
        claim_compares, claim_ops = _claim_guard(store, domain_uid, current, claim)
        compares: list[Compare] = [
            Unchanged(member_key, member.mod_revision),
            Unchanged(binding_key, binding.mod_revision) if binding else Absent(binding_key),
            *claim_compares,
        ]
        ops: list[Op] = [Put(member_key, resumed), *claim_ops]
        if binding is None:
            # A member always has its binding; put back one that went missing.
            ops.append(Put(binding_key, pb.NodeBinding(node_name=node.name, domain_uid=domain_uid)))
        if (await store.txn(compares, ops)).succeeded:
            was_lost = current.state == pb.MemberState.LOST
            log.info(
                "member active again" if was_lost else "member address updated",
                cd_uid=domain_uid,
                node=node.name,
                clique=current.clique_id,
                index=current.index,
                address=address,
            )
            return JoinResult(resumed, was_lost, tries)
        await asyncio.sleep(backoff.next_delay())
    raise ConflictError(f"join of {node.name} to domain {domain_uid} lost {max_attempts} races")


async def activate_member(
    store: Store,
    domain_uid: str,
    node_name: str,
    expected_revision: int,
    extra_compares: Iterable[Compare] = (),
) -> bool:
    """The controller's side of a node's return: its member ACTIVE again, same index.

    The address comes from the node record, which must exist (compared in the same
    transaction), as must the member at `expected_revision`. Also refreshes the address of
    an active member whose node record shows a new one. False when there is nothing to do
    or a concurrent write won.
    """
    keys = store.keys
    member_key = keys.member(domain_uid, node_name)
    node_key = keys.node(node_name)
    _, member, claim = await _read_for_resume(store, domain_uid, node_name)
    record = await store.get(node_key, pb.Node)
    if member is None or member.mod_revision != expected_revision or record is None:
        return False
    current = member.value
    if not holds_index(current):
        return False
    address = record.value.ip_address or current.ip_address
    if current.state == pb.MemberState.ACTIVE and current.ip_address == address:
        return False
    resumed = pb.Member().parse(bytes(current))
    resumed.state = pb.MemberState.ACTIVE
    resumed.ip_address = address
    claim_compares, claim_ops = _claim_guard(store, domain_uid, current, claim)
    compares: list[Compare] = [
        Unchanged(member_key, member.mod_revision),
        Unchanged(node_key, record.mod_revision),
        *claim_compares,
        *extra_compares,
    ]
    result = await store.txn(compares, [Put(member_key, resumed), *claim_ops])
    if result.succeeded:
        log.info(
            "member active again" if current.state == pb.MemberState.LOST else "member address updated",
            cd_uid=domain_uid,
            node=node_name,
            clique=current.clique_id,
            index=current.index,
            address=address,
        )
    return result.succeeded
