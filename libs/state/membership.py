"""Domain membership: joining, leaving and losing nodes, with central index assignment.

Shared by the node agent (join on first prepare, leave on last unprepare), the
controller (node loss) and the tests. Each step is one etcd transaction that
compares what it read, so concurrent joins never hand out an index twice and
a node is never in two domains (SPEC §4 invariants 1 and 2). Upstream assigns
indices client-side and races (#816, #1050); here the store arbitrates.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass

import structlog

from libs.gen.computedomain.state import v1 as pb
from libs.runtime.backoff import Backoff
from libs.state.codec import encode_payload
from libs.state.store import (
    Absent,
    Compare,
    ConflictError,
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


class NodeBusy(RuntimeError):
    """The node is a member of another domain (retryable: it may leave soon)."""

    def __init__(self, node: str, other_domain: str) -> None:
        super().__init__(f"node {node} is busy: it is a member of domain {other_domain}")
        self.node = node
        self.other_domain = other_domain


class CliqueFull(RuntimeError):
    """Every index of the node's clique in this domain is taken."""


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
    binding = store.decode_kv(reads[0][0], pb.NodeBinding) if reads[0] else None
    member = store.decode_kv(reads[1][0], pb.Member) if reads[1] else None
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


def _int32_field(number: int, value: int) -> bytes:
    """A non-negative int32 field as protobuf writes it (proto3 omits 0)."""
    if value == 0:
        return b""
    out = bytearray([number << 3])
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


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
            )
        )
        self._claim_head = bytes(pb.IndexClaim(domain_uid=claim.domain_uid, clique_id=claim.clique_id))
        self._claim_tail = bytes(pb.IndexClaim(node_name=claim.node_name))

    def member_value(self, index: int) -> bytes:
        return encode_payload(pb.Member, self._member_head + _int32_field(4, index) + self._member_tail)

    def claim_value(self, index: int) -> bytes:
        return encode_payload(pb.IndexClaim, self._claim_head + _int32_field(3, index) + self._claim_tail)


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
    view = _join_view(store, (await store.txn([], reads)).reads)
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
    )
    binding_put = Put(binding_key, pb.NodeBinding(node_name=node.name, domain_uid=domain_uid))
    records = _IndexedRecords(new_member, pb.IndexClaim(domain_uid, node.clique_id, 0, node.name))
    for attempt in range(1, max_attempts + 1):
        binding, member = view.binding, view.member
        if binding is not None and binding.value.domain_uid != domain_uid:
            raise NodeBusy(node.name, binding.value.domain_uid)
        if member is not None and member.value.state == pb.MemberState.ACTIVE:
            return JoinResult(member.value, False, attempt)

        compares: list[Compare] = [
            Unchanged(binding_key, binding.mod_revision) if binding else Absent(binding_key),
            Unchanged(member_key, member.mod_revision) if member else Absent(member_key),
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
    """The node's lease expired: free its index and drop it from peers' config, keep its binding.

    The binding stays so that the node cannot join another domain while this
    domain still counts it; the returning agent leaves or rejoins. Returns
    False if the member was not active (nothing to do) or a concurrent write won.
    """
    keys = store.keys
    member_key = keys.member(domain_uid, node_name)
    member = await store.get(member_key, pb.Member)
    if member is None or member.value.state != pb.MemberState.ACTIVE:
        return False
    lost = pb.Member().parse(bytes(member.value))
    lost.state = pb.MemberState.LOST
    lost.index = NON_FABRIC_INDEX
    ops: list[Op] = [Put(member_key, lost)]
    if member.value.index >= 0:
        ops.append(Delete(keys.member_index(domain_uid, member.value.clique_id, member.value.index)))
    result = await store.txn([Unchanged(member_key, member.mod_revision), *extra_compares], ops)
    if result.succeeded:
        log.warning("member lost", cd_uid=domain_uid, node=node_name, clique=member.value.clique_id)
    return result.succeeded
