"""A domain's spec.numNodes for the extender: from the followed domain view, the store as fallback."""

from __future__ import annotations

import asyncio

from libs.gen.computedomain.state import v1 as pb
from libs.runtime.cancellation import cancel_until_done
from libs.state.domain_record import DomainRecord as DomainGate
from libs.state.store import Store
from services.advisor.domain_presence import DomainPresence
from services.advisor.domain_sources import StoreDomainSizes
from tests.polling import eventually

UID = "0f3c1d9e-5a77-4b6e-8f0a-6d2b9c4e1a01"


def domain(num_nodes: int, deleting: bool = False) -> pb.ComputeDomain:
    return pb.ComputeDomain(
        uid=UID,
        namespace="team-a",
        name="trainer",
        spec=pb.ComputeDomainSpec(num_nodes=num_nodes),
        deleting=deleting,
    )


async def size_becomes(sizes: StoreDomainSizes, expected: int | None, within_s: float = 10.0) -> None:
    seen: list[int | None] = []

    async def reached() -> bool:
        seen.append(await sizes.num_nodes(UID))
        return seen[-1] == expected

    await eventually(
        reached, f"numNodes to become {expected}", within_s, explain=lambda: f"numNodes is {seen[-1]}"
    )


async def test_a_followed_domain_s_size_comes_from_the_view_and_follows_its_changes(store: Store) -> None:
    presence = DomainPresence()
    sizes = StoreDomainSizes(store, presence)
    follow = asyncio.create_task(presence.follow(store))
    try:
        await store.put(store.keys.domain(UID), domain(4))
        await eventually(
            lambda: presence.num_nodes(UID) is not None, "the domain's record in the followed view"
        )
        assert presence.num_nodes(UID) == 4 and presence.state(UID) == "present"
        assert await sizes.num_nodes(UID) == 4
        await store.put(store.keys.domain(UID), domain(8))
        await size_becomes(sizes, 8)
        await store.put(store.keys.domain(UID), domain(0))  # numNodes unset: the pod's hint decides
        await size_becomes(sizes, None)
    finally:
        await cancel_until_done([follow])


async def test_the_view_answers_without_the_store_and_an_unseen_domain_is_read_from_it(store: Store) -> None:
    await store.put(store.keys.domain(UID), domain(8))
    presence = DomainPresence()
    sizes = StoreDomainSizes(store, presence)
    assert await sizes.num_nodes(UID) == 8  # not in the view yet (just created): read
    presence.apply(UID, DomainGate(uid=UID, spec=pb.ComputeDomainSpec(num_nodes=4)))
    assert await sizes.num_nodes(UID) == 4  # the view's answer, though the store says 8
    presence.apply(UID, DomainGate(uid=UID, deleting=True))
    assert presence.num_nodes(UID) is None
    presence.apply_unreadable("only-its-key-was-seen")
    assert presence.num_nodes("only-its-key-was-seen") is None
    assert await sizes.num_nodes(UID) == 8  # gone from the view: the store's record decides
    await store.delete(store.keys.domain(UID))
    assert await sizes.num_nodes(UID) is None
