"""The controller against a real etcd: status, node loss, teardown, orphans, fencing."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from libs.gen.computedomain.state import v1 as pb
from libs.invariants.checker import check_domain_gone, check_store_invariants
from libs.state.config import EtcdConfig
from libs.state.election import Leadership
from libs.state.store import Store
from services.controller.actions import DeleteDomain, ReleaseMember
from services.controller.reconciler import FenceLost
from tests.controller.harness import (
    AgentDouble,
    caught_up,
    create_domain,
    domain_status,
    ready_reason,
    request_deletion,
    running_controller,
)
from tests.polling import eventually

CLIQUE = "c0ffee00-0000-4000-8000-000000000001.1"
# Invariant 5 also looks for processes whose command line names the uid: use uids nothing else names.
GONE = f"gone-{uuid.uuid4().hex}"


async def agents(
    store: Store, n: int, clique: str = CLIQUE, ttl_s: int = 2, first: int = 1
) -> list[AgentDouble]:
    out = [
        AgentDouble(store, f"node{i}", clique, f"127.0.10.{i}", ttl_s=ttl_s) for i in range(first, first + n)
    ]
    await asyncio.gather(*(a.start() for a in out))
    return out


async def wait_reason(store: Store, uid: str, status: str, reason: str, timeout_s: float = 10.0) -> tuple:
    async def probe() -> tuple | None:
        got = ready_reason(await domain_status(store, uid))
        return got if got is not None and got[:2] == (status, reason) else None

    return await eventually(probe, f"{uid} to be {status}/{reason}", timeout_s)


async def test_domain_goes_from_waiting_to_ready_as_daemons_come_up(
    store: Store, etcd_config: EtcdConfig
) -> None:
    async with running_controller(etcd_config) as controller:
        await create_domain(store, "d1", num_nodes=3)
        await wait_reason(store, "d1", "NOT_READY", "WaitingForNodes")
        nodes = await agents(store, 3)
        for a in nodes:
            await a.prepare("d1", "ns")
        _, _, message = await wait_reason(store, "d1", "NOT_READY", "ImexDaemonsNotReady")
        assert "0 of 3" in message
        for a in nodes[:2]:
            await a.report_daemon("d1", pb.DaemonState.READY)
        await nodes[2].report_daemon("d1", pb.DaemonState.FAILED, "bind: address already in use")
        _, _, message = await wait_reason(store, "d1", "NOT_READY", "ImexDaemonFailed")
        assert "node3" in message and "address already in use" in message
        # READY is not enough: its daemon must reach every other member of its clique.
        await nodes[2].report_daemon("d1", pb.DaemonState.READY, connected=["node1"])
        _, _, message = await wait_reason(store, "d1", "NOT_READY", "WaitingForPeers")
        assert "node3 to node2" in message
        await nodes[2].report_daemon("d1", pb.DaemonState.READY)
        await wait_reason(store, "d1", "READY", "AllNodesReady")
        status = await domain_status(store, "d1")
        assert status is not None
        assert [(n.name, n.index, n.status) for n in status.nodes] == [
            ("node1", 0, pb.Readiness.READY),
            ("node2", 1, pb.Readiness.READY),
            ("node3", 2, pb.Readiness.READY),
        ]
        # Once converged, nothing more is written: status writes happen only on change.
        await caught_up(store, controller)
        writes = controller.metrics.status_writes._value.get()
        reconciles = controller.metrics.reconciles._value.get()
        for a in nodes:
            await a.report_daemon("d1", pb.DaemonState.READY)  # same state again: events, no change
        await caught_up(store, controller)
        assert controller.metrics.reconciles._value.get() > reconciles, "the events were looked at"
        assert controller.metrics.status_writes._value.get() == writes
        assert await check_store_invariants(store) == []
        for a in nodes:
            await a.stop()


async def member_state(store: Store, uid: str, node: str) -> tuple[str, int] | None:
    got = await store.get(store.keys.member(uid, node), pb.Member)
    return (pb.MemberState(got.value.state).name, got.value.index) if got is not None else None


async def test_lost_node_keeps_its_index_and_gets_it_back_when_it_returns(
    store: Store, etcd_config: EtcdConfig
) -> None:
    ttl_s = 2
    async with running_controller(etcd_config):
        await create_domain(store, "d1", num_nodes=4)
        nodes = await agents(store, 4, ttl_s=ttl_s)
        for a in nodes:
            await a.prepare("d1", "ns")
        for a in nodes:
            await a.report_daemon("d1", pb.DaemonState.READY)
        await wait_reason(store, "d1", "READY", "AllNodesReady")
        victim = nodes[2]
        survivors = [a for a in nodes if a is not victim]
        lost_index = (await member_state(store, "d1", victim.name) or ("", -9))[1]

        await victim.kill()
        killed_at = time.monotonic()
        # The node is dead: its peers' links to it drop, and they say so.
        for a in survivors:
            await a.report_daemon(
                "d1", pb.DaemonState.READY, connected=[b.name for b in survivors if b is not a]
            )
        _, _, message = await wait_reason(store, "d1", "NOT_READY", "NodeLost", timeout_s=ttl_s + 3)
        seen_after = time.monotonic() - killed_at
        assert f"{victim.name} (index {lost_index})" in message and "kept" in message

        async def marked_lost() -> tuple[str, int] | None:
            got = await member_state(store, "d1", victim.name)
            return got if got is not None and got[0] == "LOST" else None

        marked = await eventually(marked_lost, "the member to be marked LOST", timeout_s=ttl_s + 3)
        marked_after = time.monotonic() - killed_at
        print(
            f"\nnode loss: NodeLost in status after {seen_after:.2f} s, member LOST after {marked_after:.2f} s (TTL {ttl_s} s)"
        )
        assert seen_after <= ttl_s + 1.0 and marked_after <= ttl_s + 1.0
        # It keeps its index, the index's claim and its binding.
        assert marked == ("LOST", lost_index)
        claim = await store.get(store.keys.member_index("d1", CLIQUE, lost_index), pb.IndexClaim)
        assert claim is not None and claim.value.node_name == victim.name
        binding = await store.get(store.keys.node_binding(victim.name), pb.NodeBinding)
        assert binding is not None and binding.value.domain_uid == "d1"
        status = await domain_status(store, "d1")
        assert status is not None
        lost_entry = next(n for n in status.nodes if n.name == victim.name)
        assert (lost_entry.status, lost_entry.index) == (pb.Readiness.NOT_READY, lost_index)
        assert all(n.status == pb.Readiness.READY for n in status.nodes if n.name != victim.name)
        # A replacement node takes a free index, never the lost node's.
        newcomer = (await agents(store, 1, first=9))[0]
        joined = await newcomer.prepare("d1", "ns")
        assert joined.member.index == 4

        # The node comes back, still holding its claim: the controller makes it active at its index.
        await victim.start()

        async def active_again() -> tuple[str, int] | None:
            got = await member_state(store, "d1", victim.name)
            return got if got is not None and got[0] == "ACTIVE" else None

        assert await eventually(active_again, "the member to be ACTIVE again", timeout_s=5) == (
            "ACTIVE",
            lost_index,
        )
        for a in [*nodes, newcomer]:
            await a.report_daemon("d1", pb.DaemonState.READY)
        await wait_reason(store, "d1", "READY", "AllNodesReady")
        status = await domain_status(store, "d1")
        assert status is not None
        assert [(n.name, n.index) for n in status.nodes] == [
            ("node1", 0),
            ("node2", 1),
            ("node3", 2),
            ("node4", 3),
            ("node9", 4),
        ]
        assert await check_store_invariants(store, quiescent=False) == []
        for a in [*nodes, newcomer]:
            await a.stop()


async def test_loss_is_not_declared_while_a_peer_reports_the_node_connected(
    store: Store, etcd_config: EtcdConfig
) -> None:
    ttl_s = 2
    async with running_controller(etcd_config) as controller:
        await create_domain(store, "d1")
        nodes = await agents(store, 3, ttl_s=ttl_s)
        for a in nodes:
            await a.prepare("d1", "ns")
        for a in nodes:
            await a.report_daemon("d1", pb.DaemonState.READY)
        await wait_reason(store, "d1", "READY", "AllNodesReady")
        victim, b, c = nodes

        async def settled() -> bool:
            """The controller saw the record go and b's latest report, and has nothing left to do."""
            seen = controller.view.daemons.get("d1", {}).get(b.name)
            return (
                victim.name not in controller.view.nodes
                and seen is not None
                and seen.connected_nodes == frozenset(b_reports)
                and len(controller.queue) == 0
                and controller.queue.processing == 0
            )

        # Only the node's IMEX side died: its daemon still talks to its peers, which say so.
        b_reports = [victim.name, c.name]
        await victim.kill()
        await eventually(settled, "the controller to handle the record's expiry", timeout_s=ttl_s + 3)
        assert await member_state(store, "d1", victim.name) == ("ACTIVE", 0)
        assert ready_reason(await domain_status(store, "d1"))[:2] == ("READY", "AllNodesReady")  # type: ignore[index]
        # One peer is enough to vouch for it.
        b_reports = [c.name]
        await b.report_daemon("d1", pb.DaemonState.READY, connected=b_reports)
        await eventually(settled, "the controller to handle the report")
        assert await member_state(store, "d1", victim.name) == ("ACTIVE", 0)
        # The last link drops: now it is lost (keeping its index).
        await c.report_daemon("d1", pb.DaemonState.READY, connected=[b.name])
        await wait_reason(store, "d1", "NOT_READY", "NodeLost")
        assert await member_state(store, "d1", victim.name) == ("LOST", 0)
        for a in nodes:
            await a.stop()


async def test_lost_node_coming_back_without_claims_is_released(
    store: Store, etcd_config: EtcdConfig
) -> None:
    async with running_controller(etcd_config):
        await create_domain(store, "d1")
        (a, b) = await agents(store, 2)
        claim = "claim-a"
        await a.prepare("d1", "ns", claim)
        await b.prepare("d1", "ns")
        await a.kill()
        await wait_reason(store, "d1", "NOT_READY", "NodeLost", timeout_s=5)
        # Its workload went away meanwhile (kubelet unprepared elsewhere / pod deleted).
        await a.store.delete(a.store.keys.preparation(a.name, claim))
        await a.start()

        async def released() -> bool:
            return await store.get(store.keys.member("d1", a.name), pb.Member) is None

        await eventually(released, "the lost member to be released", timeout_s=5)
        assert await store.get(store.keys.node_binding(a.name), pb.NodeBinding) is None
        await b.report_daemon("d1", pb.DaemonState.READY)
        await wait_reason(store, "d1", "READY", "AllNodesReady")
        await a.stop()
        await b.stop()


async def test_teardown_leaves_no_record(store: Store, etcd_config: EtcdConfig) -> None:
    uid = f"td-{uuid.uuid4().hex}"
    async with running_controller(etcd_config) as controller:
        await create_domain(store, uid)
        nodes = await agents(store, 3)
        for a in nodes:
            await a.prepare(uid, "ns")
        for a in nodes:
            await a.report_daemon(uid, pb.DaemonState.READY)
        await wait_reason(store, uid, "READY", "AllNodesReady")
        await request_deletion(store, uid)
        _, _, message = await wait_reason(store, uid, "NOT_READY", "Terminating")
        assert "3 member" in message
        # While pods still run the domain stays (terminating) and keeps its members.
        await caught_up(store, controller)
        assert await store.get(store.keys.domain(uid), pb.ComputeDomain) is not None
        members, _ = await store.list(store.keys.members(uid), pb.Member)
        assert len(members) == 3
        for a in nodes:
            await a.unprepare_all()

        async def gone() -> bool:
            return not await check_domain_gone(store, uid)

        await eventually(gone, "the domain to be torn down", timeout_s=10)
        assert await check_domain_gone(store, uid) == []
        for a in nodes:
            await a.stop()


async def test_an_undecodable_value_among_the_members_does_not_hold_a_deleted_domain(
    store: Store, etcd_config: EtcdConfig
) -> None:
    uid = f"td-{uuid.uuid4().hex}"
    garbage_key = store.keys.member(uid, "garbage")
    async with running_controller(etcd_config):
        await create_domain(store, uid)
        (a,) = await agents(store, 1)
        await a.prepare(uid, "ns")
        await store.client.put(garbage_key.encode(), b"\x00not a record of ours")
        await request_deletion(store, uid)
        await a.unprepare_all()

        async def gone() -> bool:
            return not await check_domain_gone(store, uid)

        await eventually(gone, "the domain to be torn down", timeout_s=10)
        assert await store.client.get(garbage_key.encode()) is None
        await a.stop()


async def test_teardown_completes_when_a_member_node_is_dead(store: Store, etcd_config: EtcdConfig) -> None:
    uid = f"td-{uuid.uuid4().hex}"
    async with running_controller(etcd_config):
        await create_domain(store, uid)
        alive, dead = await agents(store, 2)
        await alive.prepare(uid, "ns")
        await dead.prepare(uid, "ns")  # prepared, then its node dies: nobody will unprepare it
        await dead.kill()
        await wait_reason(store, uid, "NOT_READY", "NodeLost", timeout_s=5)
        await request_deletion(store, uid)
        await alive.unprepare_all()

        async def gone() -> bool:
            return not await check_domain_gone(store, uid)

        await eventually(gone, "teardown despite the dead node", timeout_s=10)
        await alive.stop()


async def test_join_that_raced_teardown_is_released_after_grace(
    store: Store, etcd_config: EtcdConfig
) -> None:
    async with running_controller(etcd_config, orphan_grace_s=0.5):
        (a,) = await agents(store, 1)
        # Records of a join whose domain is gone (a join itself now refuses a missing domain).
        await a.plant_orphan_membership(GONE, "ns")

        await asyncio.sleep(0.2)
        assert await store.get(store.keys.member(GONE, a.name), pb.Member) is not None, (
            "released before grace"
        )
        # The agent's prepare then fails (no such domain): it drops its claim record, and a
        # crash right after leaves the membership behind for the controller to clean up.
        for claim in list(a.claims):
            await store.delete(store.keys.preparation(a.name, claim))

        async def released() -> bool:
            return not await check_domain_gone(store, GONE)

        await eventually(released, "the orphan member to be released", timeout_s=5)
        assert await store.get(store.keys.node_binding(a.name), pb.NodeBinding) is None
        await a.stop()


async def test_deposed_leader_writes_fail_on_the_fence(store: Store, etcd_config: EtcdConfig) -> None:
    async with running_controller(etcd_config) as controller:
        await create_domain(store, "d1")
        await wait_reason(store, "d1", "NOT_READY", "WaitingForNodes")
        key = store.keys.election("cd-controller")
        record = await store.get(key, pb.LeaderRecord)
        assert record is not None
        old = Leadership("cd-controller", "old", key, record.create_revision, record.lease, 0.0)
        # Leadership moves on: the key is recreated by someone else (new create revision).
        await store.revoke_lease(record.lease)
        lease = await store.grant_lease(5)
        await store.put(key, pb.LeaderRecord(holder="usurper"), lease=lease)
        before = await store.get(store.keys.domain("d1"), pb.ComputeDomain)
        (a,) = await agents(store, 1)
        await a.prepare("d1", "ns")
        await eventually(lambda: _has_member(controller, "d1"), "the view to see the member")
        with pytest.raises(FenceLost):
            await controller.reconcile("d1", old)
        after = await store.get(store.keys.domain("d1"), pb.ComputeDomain)
        assert before is not None and after is not None and after.mod_revision == before.mod_revision
        await store.revoke_lease(lease)
        await a.stop()


async def _has_member(controller, uid: str) -> bool:
    return bool(controller.view.members.get(uid))


async def test_orphan_release_is_refused_when_the_domain_exists_after_all(
    store: Store, etcd_config: EtcdConfig
) -> None:
    """The members watch may deliver a join before the domains watch delivers the domain."""
    async with running_controller(etcd_config) as controller:
        await create_domain(store, "d1")
        (a,) = await agents(store, 1)
        await a.prepare("d1", "ns")
        member = await store.get(store.keys.member("d1", a.name), pb.Member)
        assert member is not None and controller._leadership is not None
        stale_view_decision = ReleaseMember(
            a.name, CLIQUE, member.value.index, member.mod_revision, "domain does not exist", orphan=True
        )
        assert not await controller._apply("d1", stale_view_decision, controller._leadership)
        assert await store.get(store.keys.member("d1", a.name), pb.Member) is not None
        assert await store.get(store.keys.node_binding(a.name), pb.NodeBinding) is not None
        await a.stop()


async def test_a_deletion_decided_before_the_view_saw_a_join_removes_nothing(
    store: Store, etcd_config: EtcdConfig
) -> None:
    """Each resource has its own watch: the domains watch may show the deletion before the members
    watch shows a join made before it. The plan then sees no member; the store must refuse."""
    async with running_controller(etcd_config) as controller:
        await create_domain(store, "d1")
        (a,) = await agents(store, 1)
        await a.prepare("d1", "ns")
        await request_deletion(store, "d1")
        domain = await store.get(store.keys.domain("d1"), pb.ComputeDomain)
        assert domain is not None and domain.value.deleting and controller._leadership is not None
        stale_view_decision = DeleteDomain(domain.mod_revision)
        assert not await controller._apply("d1", stale_view_decision, controller._leadership)
        assert await store.get(store.keys.domain("d1"), pb.ComputeDomain) is not None
        assert await store.get(store.keys.member("d1", a.name), pb.Member) is not None
        await a.stop()


async def test_an_undecodable_domain_value_is_counted_and_dropped_from_the_view(
    store: Store, etcd_config: EtcdConfig
) -> None:
    async with running_controller(etcd_config) as controller:
        await create_domain(store, "good")
        bad = f"bad-{uuid.uuid4().hex}"
        await store.put_raw(store.keys.domain(bad), b"\x00\xffnot a protobuf envelope")
        await caught_up(store, controller)
        sample = controller.metrics.registry.get_sample_value(
            "cd_controller_undecodable_values_total", {"resource": "domains"}
        )
        assert sample == 1.0
        assert bad not in controller.view.domains and "good" in controller.view.domains
        await store.delete(store.keys.domain(bad))
