"""The extender's reservations go once they have served or their domain is gone (real etcd).

The scheduler's view: the first pod of a domain reserves nodes for all its pods. Before the
reaper, those reservations held their nodes for the whole TTL (300 s), after the pods were bound
and after the domain was deleted, so the next job on the same rack stayed Pending for minutes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import structlog

from libs.gen.computedomain.state import v1 as pb
from libs.runtime.cancellation import cancel_until_done
from libs.state.config import EtcdConfig
from libs.state.store import Store, StoreUnavailable
from services.advisor.advisor import Advisor
from services.advisor.domain_placement import DomainPlacer
from services.advisor.domain_presence import DomainPresence
from services.advisor.fleet_feeds import start_feeds, wait_until
from services.advisor.fleet_index import FleetIndex
from services.advisor.reservation_ids import ExtenderIds, shared_key
from services.advisor.reservation_reaper import ABSENT_GRACE_S, SERVED, ReservationReaper
from services.advisor.reservations import remove_if_unchanged, write_reservation
from tests.advisor.fleet import bind, cluster_records, put_nodes
from tests.advisor.harness import Running, running_advisor, settings_for
from tests.polling import VirtualClock, eventually
from tools.sim.hardware.cluster import ClusterDescription

PAYLOADS = Path(__file__).parent / "payloads"
RACK = ClusterDescription(racks=1, trays_per_rack=18, seed="reaper-rack")
FOUR_RACKS = ClusterDescription(racks=4, trays_per_rack=18, seed="reaper-racks")
NAMESPACE = "team-a"


def domain_record(uid: str, num_nodes: int, deleting: bool = False) -> pb.ComputeDomain:
    return pb.ComputeDomain(
        uid=uid,
        namespace=NAMESPACE,
        name=f"cd-{uid}",
        spec=pb.ComputeDomainSpec(
            num_nodes=num_nodes, channel=pb.ChannelSpec(resource_claim_template_name=f"{uid}-channel")
        ),
        deleting=deleting,
    )


def pod(uid: str, index: int, nodes: list[str]) -> dict[str, Any]:
    """ExtenderArgs for pod `index` of the domain's job, as kube-scheduler sends them."""
    args = json.loads((PAYLOADS / "filter_nodecache.json").read_text())
    args["NodeNames"] = list(nodes)
    args["Pod"]["metadata"]["name"] = f"{uid}-worker-{index}"
    args["Pod"]["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] = f"{uid}-channel"
    return args


RELEASED = "extender reservation released"


async def reservation(store: Store, rid: str) -> pb.Reservation | None:
    found = await store.get(store.keys.reservation(rid), pb.Reservation)
    return found.value if found is not None else None


async def guards(store: Store) -> dict[str, str]:
    """node -> id of the reservation guarding it."""
    items, _ = await store.list(store.keys.node_reservations(), pb.Reservation)
    return {i.value.node_names[0]: i.value.id for i in items}


def released(running: Running, reason: str) -> float:
    value = running.service.metrics.registry.get_sample_value(
        "cd_advisor_extender_reservations_released_total", {"reason": reason}
    )
    return value or 0.0


async def filter_pod(session: aiohttp.ClientSession, running: Running, args: dict[str, Any]) -> list[str]:
    url = f"http://127.0.0.1:{running.service.extender_port}/filter"
    async with session.post(url, json=args, timeout=aiohttp.ClientTimeout(total=10)) as response:
        assert response.status == 200, await response.text()
        result = await response.json()
    assert result["Error"] == "", result
    return list(result["NodeNames"])


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def test_an_18_node_job_deleted_and_applied_again_schedules_at_once(
    etcd_config: EtcdConfig, store: Store, session: aiohttp.ClientSession
) -> None:
    """The bug as a user met it: the second job's pods found the rack reserved for the first."""
    records = cluster_records(RACK)
    nodes = [r.name for r in records]
    await put_nodes(store, records)
    await store.put(store.keys.domain("job-1"), domain_record("job-1", 18))
    async with running_advisor(settings_for(etcd_config, identity="r1")) as advisor:
        ids = ExtenderIds(await shared_key(store))
        assert sorted(await filter_pod(session, advisor, pod("job-1", 0, nodes))) == sorted(nodes)
        rid = ids.make("job-1", 0)
        assert (await reservation(store, rid)) is not None
        # Pods bind one by one: while one node is not bound yet, the reservation stays.
        for node in nodes[:-1]:
            await bind(store, node, "job-1")
        await asyncio.sleep(1.0)
        assert (await reservation(store, rid)) is not None
        assert released(advisor, "served") == 0
        await bind(store, nodes[-1], "job-1")

        async def gone() -> bool:
            # Counted once the release's transaction answered: maybe just after the records go.
            records_gone = await reservation(store, rid) is None and not await guards(store)
            return records_gone and released(advisor, "served") == 1

        await eventually(gone, "the served reservation to be released", 5.0)
        # The bindings hold the nodes now: another domain cannot have them.
        await store.put(store.keys.domain("other"), domain_record("other", 1))
        args = pod("other", 0, nodes)
        url = f"http://127.0.0.1:{advisor.service.extender_port}/filter"
        async with session.post(url, json=args) as response:
            assert (await response.json())["NodeNames"] == []

        # kubectl delete: the pods go (their nodes leave the domain), then the domain record.
        for node in nodes:
            await store.delete(store.keys.node_binding(node))
        await store.delete(store.keys.domain("job-1"))
        fleet = advisor.service.fleet
        assert await wait_until(fleet, lambda: not fleet.bound, 5.0)
        # kubectl apply again: a new domain of 18 gets the whole rack at once, not after 300 s.
        await store.put(store.keys.domain("job-2"), domain_record("job-2", 18))
        assert sorted(await filter_pod(session, advisor, pod("job-2", 0, nodes))) == sorted(nodes)
        assert advisor.service.health.healthy


@pytest.mark.parametrize("how", ["marked deleting", "record deleted"])
async def test_deleting_a_domain_releases_all_its_extender_reservations_and_no_other(
    etcd_config: EtcdConfig, store: Store, session: aiohttp.ClientSession, how: str
) -> None:
    records = cluster_records(RACK)
    nodes = [r.name for r in records]
    await put_nodes(store, records)
    await store.put(store.keys.domain("doomed"), domain_record("doomed", 6))
    await store.put(store.keys.domain("bystander"), domain_record("bystander", 2))
    async with running_advisor(settings_for(etcd_config, identity="r1")) as advisor:
        ids = ExtenderIds(await shared_key(store))
        reserved = await filter_pod(session, advisor, pod("doomed", 0, nodes))
        assert len(reserved) == 6
        # Only two of its pods were bound when the job was deleted.
        for node in reserved[:2]:
            await bind(store, node, "doomed")
        bystander = await filter_pod(session, advisor, pod("bystander", 0, nodes))
        # A scheduler of its own (a gRPC client) reserved two nodes for the same domain.
        free = [n for n in nodes if n not in reserved and n not in bystander]
        theirs = await advisor.service.advisor.reserve_nodes(free[:2], "doomed", 60, "kai-scheduler", "kai-1")
        assert theirs.id == "kai-1"

        if how == "marked deleting":
            await store.put(store.keys.domain("doomed"), domain_record("doomed", 6, deleting=True))
        else:
            await store.delete(store.keys.domain("doomed"))

        async def released_at_once() -> bool:
            # The advisor counts the release once its transaction has answered, which may be a
            # moment after this client already sees the record gone.
            gone = await reservation(store, ids.make("doomed", 0)) is None
            return gone and released(advisor, "domain-deleted") == 1

        await eventually(released_at_once, "the deleted domain's reservation to go", 5.0)
        left = await guards(store)
        # The four nodes it never used are free again; the other holder's and the other domain's stay.
        assert not set(reserved) & set(left)
        assert (await reservation(store, "kai-1")) is not None
        assert {n: left[n] for n in free[:2]} == {n: "kai-1" for n in free[:2]}
        assert (await reservation(store, ids.make("bystander", 0))) is not None
        await asyncio.sleep(1.0)  # and stay so
        assert (await reservation(store, "kai-1")) is not None
        assert advisor.service.health.healthy


async def test_two_replicas_release_each_reservation_once_and_stay_healthy(
    etcd_config: EtcdConfig, store: Store, session: aiohttp.ClientSession
) -> None:
    records = cluster_records(RACK)
    nodes = [r.name for r in records]
    await put_nodes(store, records)
    await store.put(store.keys.domain("shared"), domain_record("shared", 8))
    await store.put(store.keys.domain("brief"), domain_record("brief", 4))
    async with AsyncExitStack() as stack:
        r1 = await stack.enter_async_context(running_advisor(settings_for(etcd_config, identity="r1")))
        r2 = await stack.enter_async_context(running_advisor(settings_for(etcd_config, identity="r2")))
        ids = ExtenderIds(await shared_key(store))  # the replicas share it
        first = await filter_pod(session, r1, pod("shared", 0, nodes))
        assert len(first) == 8
        # The second pod reaches the other replica: it follows the same reservation.
        assert await filter_pod(session, r2, pod("shared", 1, nodes)) == first
        record = await reservation(store, ids.make("shared", 0))
        assert record is not None and record.holder == "extender/r1"
        brief = await filter_pod(session, r2, pod("brief", 0, nodes))
        assert len(brief) == 4

        # Both replicas see the bindings at once and race to release.
        await asyncio.gather(*(bind(store, n, "shared") for n in first))
        await store.delete(store.keys.domain("brief"))

        async def both_gone() -> bool:
            return (
                await reservation(store, ids.make("shared", 0)) is None
                and await reservation(store, ids.make("brief", 0)) is None
                and not await guards(store)
            )

        await eventually(both_gone, "both reservations to go", 5.0)
        await asyncio.sleep(0.5)  # the slower replica has tried too by now
        assert released(r1, "served") + released(r2, "served") == 1
        assert released(r1, "domain-deleted") + released(r2, "domain-deleted") == 1
        for running in (r1, r2):
            assert running.service.health.healthy, running.service.health.problems
            assert not running.task.done()
            assert not running.service.fleet.reservations


async def test_a_release_on_a_stale_view_leaves_a_reservation_written_anew_alone(store: Store) -> None:
    records = cluster_records(FOUR_RACKS)
    await put_nodes(store, records)
    small = [r.name for r in records[:4]]
    large = [r.name for r in records[4:74]]  # more than one transaction: a lease of its own
    for nodes, rid in ((small, "cd-d-0"), (large, "cd-d-1")):
        cliques = ["c"] * len(nodes)
        old = await write_reservation(store, nodes, cliques, "d", "extender/r1", 60, rid)
        assert await remove_if_unchanged(store, rid, nodes, old.revision) is not None
        assert await reservation(store, rid) is None
        assert not set(nodes) & set(await guards(store))
        # Another replica writes a new reservation under the same id; a release judged on the
        # old one (its revision) must not remove it.
        new = await write_reservation(store, nodes, cliques, "d", "extender/r2", 60, rid)
        assert await remove_if_unchanged(store, rid, nodes, old.revision) is None
        kept = await reservation(store, rid)
        assert kept is not None and kept.holder == "extender/r2"
        assert {n: rid for n in nodes} == {n: g for n, g in (await guards(store)).items() if n in nodes}
        assert await remove_if_unchanged(store, rid, nodes, new.revision) is not None
        # Twice is harmless: the second finds nothing of its own to remove.
        assert await remove_if_unchanged(store, rid, nodes, new.revision) is None


async def test_a_served_reservation_larger_than_a_transaction_is_released(store: Store) -> None:
    records = cluster_records(FOUR_RACKS)
    await put_nodes(store, records)
    async with reaper_setup(store) as (placer, _reaper):
        await store.put(store.keys.domain("big"), domain_record("big", 70))
        allowance = await placer.allowed_nodes("big", 70, [r.name for r in records])
        assert len(allowance.allowed) == 70
        await asyncio.gather(*(bind(store, n, "big") for n in allowance.allowed))

        async def gone() -> bool:
            return await reservation(store, placer.ids.make("big", 0)) is None and not await guards(store)

        await eventually(gone, "the 70-node reservation to go", 5.0)
        fleet = placer.advisor.fleet
        assert await wait_until(fleet, lambda: not fleet.reservations, 5.0)


async def test_a_domain_without_a_record_loses_its_reservation_after_the_grace(store: Store) -> None:
    records = cluster_records(RACK)
    nodes = [r.name for r in records]
    await put_nodes(store, records)
    # The default grace on a virtual clock: the test moves time past it instead of waiting.
    clock = VirtualClock()
    async with reaper_setup(store, clock=clock) as (placer, reaper):
        grace_s = reaper.absent_grace_s
        assert grace_s == ABSENT_GRACE_S
        with structlog.testing.capture_logs() as logs:
            # No record at all (deleted while no advisor watched); one mirrored a moment late;
            # one whose record this build cannot read (a newer controller's schema).
            for uid in ("ghost", "late", "unreadable"):
                assert len((await placer.allowed_nodes(uid, 2, nodes)).allowed) == 2
            await asyncio.sleep(0.3)
            await store.put(store.keys.domain("late"), domain_record("late", 2))
            await store.put_raw(store.keys.domain("unreadable"), b"\x00\xffnot an envelope")

            def logged(rid: str) -> bool:
                # The store shows the removal before the reaper resumes to log it.
                return any(e.get("reservation") == rid for e in logs if e["event"] == RELEASED)

            async def ghost_gone() -> bool:
                return await reservation(store, placer.ids.make("ghost", 0)) is None and logged(
                    placer.ids.make("ghost", 0)
                )

            await asyncio.sleep(0.5)  # swept twice: nothing is due inside the grace
            assert await reservation(store, placer.ids.make("ghost", 0)) is not None
            clock.advance(grace_s)
            await eventually(ghost_gone, "the absent domain's reservation to go", 5.0)
            clock.advance(grace_s)  # past the grace of the late and the unreadable record too
            await asyncio.sleep(0.5)  # swept twice more
            assert await reservation(store, placer.ids.make("late", 0)) is not None
            assert await reservation(store, placer.ids.make("unreadable", 0)) is not None
            await store.put(store.keys.domain("late"), domain_record("late", 2, deleting=True))

            async def late_gone() -> bool:
                return await reservation(store, placer.ids.make("late", 0)) is None and logged(
                    placer.ids.make("late", 0)
                )

            await eventually(late_gone, "the deleted domain's reservation to go", 5.0)
        releases = [e for e in logs if e["event"] == RELEASED]
        assert [(e["cd_uid"], e["reservation"], e["reason"]) for e in releases] == [
            ("ghost", placer.ids.make("ghost", 0), "domain-absent"),
            ("late", placer.ids.make("late", 0), "domain-deleted"),
        ]
        metrics = placer.advisor.metrics.registry
        sample = "cd_advisor_extender_reservations_released_total"
        assert metrics.get_sample_value(sample, {"reason": "domain-absent"}) == 1
        assert metrics.get_sample_value(sample, {"reason": "domain-deleted"}) == 1
        # A late pod of the deleted domain is refused by name, and nothing is reserved for it.
        refused = await placer.allowed_nodes("late", 2, nodes)
        assert not refused.allowed and not refused.resolvable
        assert "late is being deleted" in refused.message
        assert await reservation(store, placer.ids.make("late", 0)) is None


async def test_a_release_failing_on_the_store_is_retried_and_any_other_failure_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reaper = ReservationReaper(DomainPlacer(Advisor(FleetIndex()), ttl_s=60), DomainPresence())
    record = pb.Reservation(id="r1", domain_uid="cd-a", node_names=["n1"])
    monkeypatch.setattr(reaper, "due", lambda uid: [(record, SERVED)])

    async def store_unavailable(record: pb.Reservation, reason: str) -> bool:
        raise StoreUnavailable("remove r1: etcd unavailable for 30s")

    monkeypatch.setattr(reaper, "release", store_unavailable)
    assert await reaper.reap({"cd-a"}) == {"cd-a"}  # the domain's round is marked for a retry

    async def broken(record: pb.Reservation, reason: str) -> bool:
        raise RuntimeError("the advisor has no store: reservations cannot be released")

    monkeypatch.setattr(reaper, "release", broken)
    with pytest.raises(RuntimeError, match="no store"):
        await reaper.reap({"cd-a"})


@contextlib.asynccontextmanager
async def reaper_setup(
    store: Store, absent_grace_s: float = 30.0, clock: Callable[[], float] = time.monotonic
) -> AsyncIterator[tuple[DomainPlacer, ReservationReaper]]:
    """An advisor's inventory, domain presence, extender placer and reaper on the store (the
    reaper judges the absence grace on `clock`; it sweeps on the event loop's time)."""
    fleet = FleetIndex()
    tasks = start_feeds(fleet, store)
    presence = DomainPresence()
    placer = DomainPlacer(Advisor(fleet, store), ttl_s=60, presence=presence)
    reaper = ReservationReaper(
        placer, presence, absent_grace_s=absent_grace_s, sweep_period_s=0.2, clock=clock
    )
    reaper.attach()
    tasks.append(asyncio.create_task(presence.follow(store)))
    tasks.append(asyncio.create_task(reaper.run()))
    try:
        assert await wait_until(fleet, lambda: fleet.ready, 10.0)
        await asyncio.wait_for(presence.synced.wait(), 10.0)
        yield placer, reaper
        for task in tasks:
            if task.done() and not task.cancelled():
                task.result()  # a feed or the reaper failed: fail the test with its error
    finally:
        await cancel_until_done(tasks)
        await placer.advisor.close()
