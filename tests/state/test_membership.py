"""Central membership transactions against a real etcd."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.gen.computedomain.state import v1 as pb
from libs.state.codec import encode
from libs.state.membership import (
    CliqueFull,
    NodeBusy,
    join_domain,
    leave_domain,
    lowest_free_index,
    mark_member_lost,
)
from libs.state.store import Store
from tests.invariants import check_store_invariants


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


async def test_lost_member_frees_index_but_keeps_node_bound(store: Store) -> None:
    await join_domain(store, "d1", "ns", node("a"))
    await join_domain(store, "d1", "ns", node("b"))
    assert await mark_member_lost(store, "d1", "a")
    lost = await store.get(store.keys.member("d1", "a"), pb.Member)
    assert lost is not None and lost.value.state == pb.MemberState.LOST and lost.value.index == -1
    with pytest.raises(NodeBusy):
        await join_domain(store, "d2", "ns", node("a"))
    newcomer = await join_domain(store, "d1", "ns", node("c"))
    assert newcomer.member.index == 0
    # The lost node comes back and rejoins: it gets a fresh free index.
    back = await join_domain(store, "d1", "ns", node("a"))
    assert back.joined_now and back.member.index == 2
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
