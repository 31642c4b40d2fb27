"""Central membership transactions against a real etcd."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.gen.computedomain.state import v1 as pb
from libs.invariants.checker import check_store_invariants
from libs.state.codec import UndecodableValue, encode
from libs.state.membership import (
    CliqueFull,
    DomainUnavailable,
    IndexConflict,
    NodeBusy,
    activate_member,
    join_domain,
    leave_domain,
    lowest_free_index,
    mark_member_lost,
)
from libs.state.store import Store


@pytest.fixture(autouse=True)
async def domains(store: Store) -> None:
    """The domains these tests join (a join needs its domain to exist and not be deleting)."""
    for uid in ("d1", "d2"):
        await store.put(store.keys.domain(uid), pb.ComputeDomain(uid=uid, namespace="ns", name=uid))


def node(name: str, clique: str = "c1", ip: str = "") -> pb.Node:
    return pb.Node(name=name, clique_id=clique, ip_address=ip or f"127.9.0.{abs(hash(name)) % 250 + 1}")


@given(st.sets(st.integers(min_value=0, max_value=20)), st.integers(min_value=0, max_value=20))
def test_lowest_free_index(used: set[int], limit: int) -> None:
    got = lowest_free_index(used, limit)
    free = [i for i in range(limit) if i not in used]
    assert got == (free[0] if free else None)


async def test_join_is_idempotent_and_assigns_lowest_free(store: Store) -> None:
    a = await join_domain(store, "d1", "ns", node("a"))
    b = await join_domain(store, "d1", "ns", node("b"))
    again = await join_domain(store, "d1", "ns", node("a"))
    assert (a.member.index, b.member.index) == (0, 1)
    assert again.member.index == 0 and not again.joined_now
    assert await leave_domain(store, "d1", "a")
    c = await join_domain(store, "d1", "ns", node("c"))
    assert c.member.index == 0  # the freed index is reused
    assert await check_store_invariants(store) == []


async def test_node_in_another_domain_is_busy(store: Store) -> None:
    await join_domain(store, "d1", "ns", node("a"))
    with pytest.raises(NodeBusy, match="d1"):
        await join_domain(store, "d2", "ns", node("a"))
    assert await store.get(store.keys.member("d2", "a"), pb.Member) is None


async def test_clique_full_at_the_bound(store: Store) -> None:
    for i in range(3):
        await join_domain(store, "d1", "ns", node(f"n{i}"), max_nodes_per_clique=3)
    with pytest.raises(CliqueFull, match="3 members"):
        await join_domain(store, "d1", "ns", node("n3"), max_nodes_per_clique=3)
    # Another clique of the same domain has its own indices.
    other = await join_domain(store, "d1", "ns", node("m0", clique="c2"), max_nodes_per_clique=3)
    assert other.member.index == 0


async def test_non_fabric_node_joins_without_index(store: Store) -> None:
    joined = await join_domain(store, "d1", "ns", node("plain", clique=""))
    assert joined.member.index == -1
    items, _ = await store.list(store.keys.member_indices("d1"), pb.IndexClaim)
    assert items == []


async def claim_of(store: Store, uid: str, clique: str, index: int) -> str | None:
    got = await store.get(store.keys.member_index(uid, clique, index), pb.IndexClaim)
    return got.value.node_name if got is not None else None


async def member_of(store: Store, uid: str, name: str) -> pb.Member:
    got = await store.get(store.keys.member(uid, name), pb.Member)
    assert got is not None, f"{name} is not a member of {uid}"
    return got.value


async def test_lost_member_keeps_its_index_claim_and_binding(store: Store) -> None:
    await join_domain(store, "d1", "ns", node("a"))
    await join_domain(store, "d1", "ns", node("b"))
    assert await mark_member_lost(store, "d1", "a")
    lost = await member_of(store, "d1", "a")
    assert lost.state == pb.MemberState.LOST and lost.index == 0
    assert await claim_of(store, "d1", "c1", 0) == "a"
    assert not await mark_member_lost(store, "d1", "a")  # already lost: nothing to do
    with pytest.raises(NodeBusy):
        await join_domain(store, "d2", "ns", node("a"))
    # A replacement takes a free index, never the lost member's.
    newcomer = await join_domain(store, "d1", "ns", node("c"))
    assert newcomer.member.index == 2
    assert await check_store_invariants(store) == []


async def test_lost_node_rejoins_at_the_same_index_with_its_new_address(store: Store) -> None:
    first = await join_domain(store, "d1", "ns", node("a", ip="127.9.1.1"))
    await join_domain(store, "d1", "ns", node("b"))
    assert await mark_member_lost(store, "d1", "a")
    await join_domain(store, "d1", "ns", node("c"))
    back = await join_domain(store, "d1", "ns", node("a", ip="127.9.1.2"))
    assert back.joined_now and back.member.index == 0 and back.member.state == pb.MemberState.ACTIVE
    stored = await member_of(store, "d1", "a")
    assert (stored.state, stored.index, stored.ip_address) == (pb.MemberState.ACTIVE, 0, "127.9.1.2")
    # Everything else about the membership is what it was.
    assert stored.joined_unix_ms == first.member.joined_unix_ms and stored.namespace == "ns"
    assert await claim_of(store, "d1", "c1", 0) == "a"
    again = await join_domain(store, "d1", "ns", node("a", ip="127.9.1.2"))
    assert not again.joined_now and again.member.index == 0
    assert await check_store_invariants(store) == []


async def test_active_member_at_a_new_address_keeps_its_index(store: Store) -> None:
    await join_domain(store, "d1", "ns", node("a", ip="127.9.2.1"))
    await join_domain(store, "d1", "ns", node("b"))
    moved = await join_domain(store, "d1", "ns", node("b", ip="127.9.2.9"))
    assert not moved.joined_now and moved.member.index == 1
    assert (await member_of(store, "d1", "b")).ip_address == "127.9.2.9"


async def test_missing_claim_of_a_lost_member_is_restored_at_its_own_index(store: Store) -> None:
    await join_domain(store, "d1", "ns", node("a"))
    await join_domain(store, "d1", "ns", node("b"))
    assert await mark_member_lost(store, "d1", "a")
    await store.delete(store.keys.member_index("d1", "c1", 0))
    back = await join_domain(store, "d1", "ns", node("a"))
    assert back.member.index == 0
    assert await claim_of(store, "d1", "c1", 0) == "a"
    assert await check_store_invariants(store) == []


async def test_lost_member_whose_index_another_node_claims_is_not_moved(store: Store) -> None:
    """A broken store (claim of another node at the member's index) stops the join loudly."""
    await join_domain(store, "d1", "ns", node("a"))
    assert await mark_member_lost(store, "d1", "a")
    await store.put(store.keys.member_index("d1", "c1", 0), pb.IndexClaim("d1", "c1", 0, "intruder"))
    with pytest.raises(IndexConflict, match="intruder"):
        await join_domain(store, "d1", "ns", node("a"))
    still = await member_of(store, "d1", "a")
    assert (still.state, still.index) == (pb.MemberState.LOST, 0)


async def test_leaving_frees_the_index_of_a_lost_member(store: Store) -> None:
    await join_domain(store, "d1", "ns", node("a"))
    await join_domain(store, "d1", "ns", node("b"))
    assert await mark_member_lost(store, "d1", "a")
    assert await leave_domain(store, "d1", "a")
    assert await claim_of(store, "d1", "c1", 0) is None
    assert await store.get(store.keys.node_binding("a"), pb.NodeBinding) is None
    assert (await join_domain(store, "d1", "ns", node("c"))).member.index == 0
    assert await check_store_invariants(store) == []


async def test_activate_member_needs_the_node_record_and_the_member_as_seen(store: Store) -> None:
    await join_domain(store, "d1", "ns", node("a", ip="127.9.3.1"))
    assert await mark_member_lost(store, "d1", "a")
    lost = await store.get(store.keys.member("d1", "a"), pb.Member)
    assert lost is not None
    # No node record: the node has not come back.
    assert not await activate_member(store, "d1", "a", lost.mod_revision)
    await store.put(store.keys.node("a"), node("a", ip="127.9.3.7"))
    assert not await activate_member(store, "d1", "a", lost.mod_revision - 1)  # stale decision
    assert await activate_member(store, "d1", "a", lost.mod_revision)
    back = await member_of(store, "d1", "a")
    assert (back.state, back.index, back.ip_address) == (pb.MemberState.ACTIVE, 0, "127.9.3.7")
    current = await store.get(store.keys.member("d1", "a"), pb.Member)
    assert current is not None
    assert not await activate_member(store, "d1", "a", current.mod_revision)  # nothing to do
    assert await check_store_invariants(store) == []


async def test_legacy_lost_member_without_index_takes_a_fresh_one(store: Store) -> None:
    """A LOST member written before indices were kept (index -1) joins like a newcomer."""
    await join_domain(store, "d1", "ns", node("b"))
    legacy = pb.Member("d1", "a", "c1", -1, pb.MemberState.LOST, "127.9.4.1", 1, "ns")
    await store.put(store.keys.member("d1", "a"), legacy)
    await store.put(store.keys.node_binding("a"), pb.NodeBinding(node_name="a", domain_uid="d1"))
    back = await join_domain(store, "d1", "ns", node("a"))
    assert back.joined_now and back.member.index == 1
    assert await check_store_invariants(store) == []


async def test_concurrent_joins_in_one_clique_get_distinct_indices(store: Store) -> None:
    results = await asyncio.gather(*(join_domain(store, "d1", "ns", node(f"n{i:02d}")) for i in range(18)))
    assert sorted(r.member.index for r in results) == list(range(18))
    # etcd hands out the lowest free index inside the transaction: no joiner retries.
    assert [r.attempts for r in results] == [1] * 18
    assert await check_store_invariants(store) == []
    # The records spliced together around the index are what encoding the message gives.
    for r in results:
        raw = await store.client.get(store.keys.member("d1", r.member.node_name).encode())
        assert raw is not None and raw.value == encode(r.member)
        claim = pb.IndexClaim("d1", "c1", r.member.index, r.member.node_name)
        raw = await store.client.get(store.keys.member_index("d1", "c1", r.member.index).encode())
        assert raw is not None and raw.value == encode(claim)


async def test_a_join_takes_the_lowest_index_free_at_commit_even_from_a_stale_view(store: Store) -> None:
    for i in range(3):
        await join_domain(store, "d1", "ns", node(f"n{i}"))
    assert await leave_domain(store, "d1", "n1")
    joined = await join_domain(store, "d1", "ns", node("late"))
    assert joined.member.index == 1 and joined.attempts == 1


async def test_an_undecodable_index_claim_still_holds_its_index(store: Store) -> None:
    """A corrupted claim value must not trap joiners on its index: the key alone says it is taken."""
    await store.put_raw(store.keys.member_index("d1", "c1", 0), b"\x00\xffnot a protobuf envelope")
    joined = await join_domain(store, "d1", "ns", node("a"), max_attempts=5)
    assert joined.member.index == 1 and joined.attempts == 1


async def test_a_join_needs_its_domain_and_not_a_deleting_one(store: Store) -> None:
    with pytest.raises(DomainUnavailable, match="cannot join domain d9: it does not exist"):
        await join_domain(store, "d9", "ns", node("a"))
    await store.put(store.keys.domain("d2"), pb.ComputeDomain(uid="d2", deleting=True))
    with pytest.raises(DomainUnavailable, match="cannot join domain d2: it is being deleted"):
        await join_domain(store, "d2", "ns", node("a"))
    members, _ = await store.list(store.keys.all_members(), pb.Member)
    bindings, _ = await store.list(store.keys.node_bindings(), pb.NodeBinding)
    assert members == [] and bindings == []


@pytest.mark.parametrize("record", ["binding", "member", "domain"])
async def test_a_join_over_an_undecodable_record_fails_at_once_naming_the_key(
    store: Store, record: str
) -> None:
    """Not taken for absent (a join would then lose every race against the key that is there)."""
    keys = store.keys
    key = {"binding": keys.node_binding("a"), "member": keys.member("d1", "a"), "domain": keys.domain("d1")}[
        record
    ]
    await store.put_raw(key, b"\x00\xffnot a protobuf envelope")
    with pytest.raises(UndecodableValue, match=f"undecodable value at {key}"):
        await asyncio.wait_for(join_domain(store, "d1", "ns", node("a")), timeout=2.0)


async def test_a_join_records_the_domains_mesh_mode_in_the_member(store: Store) -> None:
    """The IMEX agent learns the mode from the member record; UNDECIDED (the controller had not
    decided yet) sends it to the domain record."""
    await store.put(store.keys.domain("d2"), pb.ComputeDomain(uid="d2", mesh_mode=pb.MeshMode.PLAINTEXT))
    plain = await join_domain(store, "d2", "ns", node("a"))
    undecided = await join_domain(store, "d1", "ns", node("b"))
    for uid, name, joined, mode in (
        ("d2", "a", plain, pb.MeshMode.PLAINTEXT),
        ("d1", "b", undecided, pb.MeshMode.UNDECIDED),
    ):
        stored = await store.get(store.keys.member(uid, name), pb.Member)
        assert stored is not None and stored.value.mesh_mode == mode
        assert joined.member.mesh_mode == mode


async def test_a_domain_removed_between_the_joins_read_and_write_fails_the_join(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The domain is torn down and created again after the join read it: the join's transaction
    compares the record's creation, so it does not land; read again, the domain is deleting."""
    real_txn = store.txn
    marked = False

    async def txn(compares, success, failure=()):  # type: ignore[no-untyped-def]
        nonlocal marked
        if compares and not marked:
            marked = True
            await store.delete(store.keys.domain("d1"))
            await store.put(store.keys.domain("d1"), pb.ComputeDomain(uid="d1", deleting=True))
        return await real_txn(compares, success, failure)

    monkeypatch.setattr(store, "txn", txn)
    with pytest.raises(DomainUnavailable, match="being deleted"):
        await join_domain(store, "d1", "ns", node("a"))
    assert marked
    assert await store.get(store.keys.member("d1", "a"), pb.Member) is None
    assert await store.get(store.keys.node_binding("a"), pb.NodeBinding) is None
