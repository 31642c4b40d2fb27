"""Test harness for the controller against a real etcd.

`AgentDouble` does in the store what a node agent does (node record on a
lease, join on the first prepare, prepared-claim records, daemon status with
its peers and the members it reports connected, leave on the last unprepare), so that controller tests need no
node agent, IMEX daemon or kubelet. `running_controller` runs one in-process
controller replica (view + leader election + reconciler).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

from libs.gen.computedomain.state import v1 as pb
from libs.imex import slots
from libs.runtime.cancellation import cancel_until_done
from libs.state.config import EtcdConfig
from libs.state.election import LeaderElection
from libs.state.lease import KeptLease
from libs.state.membership import JoinResult, join_domain, leave_domain
from libs.state.store import Store
from services.controller.metrics import ControllerMetrics
from services.controller.reconciler import DomainReconciler, ReconcilerConfig
from tests.polling import eventually

T = TypeVar("T")


class AgentDouble:
    def __init__(self, store: Store, name: str, clique: str, ip: str, ttl_s: int = 2) -> None:
        self.store = store
        self.name = name
        self.node = pb.Node(name=name, ip_address=ip, clique_id=clique, health=pb.Health.HEALTHY)
        self.ttl_s = ttl_s
        self.lease: KeptLease | None = None
        self._task: asyncio.Task[None] | None = None
        self.claims: dict[str, str] = {}  # claim uid -> domain uid

    async def start(self) -> None:
        async def write_record(lease_id: int) -> None:
            await self.store.put(self.store.keys.node(self.name), self.node, lease=lease_id)

        self.lease = KeptLease(self.store, self.ttl_s, on_acquired=write_record, regrant=True)
        self._task = asyncio.create_task(self.lease.run())
        await asyncio.wait_for(self.lease.acquired.wait(), 10)

    async def kill(self) -> None:
        """Die without a word: stop refreshing the lease, which then expires in etcd."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def stop(self) -> None:
        await self.kill()
        if self.lease is not None:
            await self.lease.revoke()

    async def prepare(self, domain_uid: str, namespace: str, claim_uid: str | None = None) -> JoinResult:
        claim = claim_uid or f"claim-{uuid.uuid4().hex[:8]}"
        key = self.store.keys.preparation(self.name, claim)
        record = pb.PreparedClaim(
            claim_uid=claim,
            namespace=namespace,
            node_name=self.name,
            domain_uid=domain_uid,
            state=pb.PreparedState.PREPARE_STARTED,
        )
        await self.store.put(key, record)
        result = await join_domain(self.store, domain_uid, namespace, self.node)
        record.state = pb.PreparedState.PREPARE_COMPLETED
        await self.store.put(key, record)
        self.claims[claim] = domain_uid
        return result

    async def plant_orphan_membership(self, domain_uid: str, namespace: str) -> JoinResult:
        """The records a prepare and join leave, for a domain that is gone: what an agent of an older
        version (whose join did not compare the domain) or a crash mid-release leaves behind.
        join_domain itself refuses a missing domain."""
        claim = f"claim-{uuid.uuid4().hex[:8]}"
        prepared = pb.PreparedClaim(
            claim_uid=claim,
            namespace=namespace,
            node_name=self.name,
            domain_uid=domain_uid,
            state=pb.PreparedState.PREPARE_COMPLETED,
        )
        await self.store.put(self.store.keys.preparation(self.name, claim), prepared)
        self.claims[claim] = domain_uid
        member = pb.Member(
            domain_uid=domain_uid,
            node_name=self.name,
            clique_id=self.node.clique_id,
            index=0,
            state=pb.MemberState.ACTIVE,
            ip_address=self.node.ip_address,
            joined_unix_ms=int(time.time() * 1000),
            namespace=namespace,
        )
        k = self.store.keys
        await self.store.put(
            k.node_binding(self.name), pb.NodeBinding(node_name=self.name, domain_uid=domain_uid)
        )
        await self.store.put(
            k.member_index(domain_uid, self.node.clique_id, 0),
            pb.IndexClaim(domain_uid=domain_uid, clique_id=self.node.clique_id, index=0, node_name=self.name),
        )
        await self.store.put(k.member(domain_uid, self.name), member)
        return JoinResult(member, True, 1)

    async def peers(self, domain_uid: str) -> list[str]:
        """The address each slot of the clique resolves to: its member's (lost ones keep their slot)."""
        members, _ = await self.store.list(self.store.keys.members(domain_uid), pb.Member)
        out = [slots.PLACEHOLDER_ADDRESS] * slots.MAX_SLOTS
        for m in members:
            if m.value.clique_id == self.node.clique_id and 0 <= m.value.index < slots.MAX_SLOTS:
                out[m.value.index] = m.value.ip_address
        return out

    async def clique_peers(self, domain_uid: str) -> list[str]:
        """Names of the other ACTIVE members of this node's clique."""
        members, _ = await self.store.list(self.store.keys.members(domain_uid), pb.Member)
        return sorted(
            m.value.node_name
            for m in members
            if m.value.state == pb.MemberState.ACTIVE
            and m.value.clique_id == self.node.clique_id
            and m.value.node_name != self.name
        )

    async def report_daemon(
        self,
        domain_uid: str,
        state: pb.DaemonState,
        error: str = "",
        connected: Sequence[str] | None = None,
    ) -> None:
        """Write this node's daemon status; `connected` defaults to every other active clique member."""
        status = pb.DaemonStatus(
            domain_uid=domain_uid,
            node_name=self.name,
            state=state,
            last_error=error,
            updated_unix_ms=int(time.time() * 1000),
            peers=await self.peers(domain_uid),
            connected_nodes=list(connected) if connected is not None else await self.clique_peers(domain_uid),
        )
        await self.store.put(self.store.keys.daemon(domain_uid, self.name), status)

    async def unprepare(self, claim_uid: str) -> None:
        domain_uid = self.claims.pop(claim_uid)
        await self.store.delete(self.store.keys.preparation(self.name, claim_uid))
        if domain_uid not in self.claims.values():
            await leave_domain(self.store, domain_uid, self.name)

    async def unprepare_all(self) -> None:
        for claim in list(self.claims):
            await self.unprepare(claim)


async def create_domain(
    store: Store, uid: str, num_nodes: int = 0, namespace: str = "ns"
) -> pb.ComputeDomain:
    domain = pb.ComputeDomain(
        uid=uid,
        namespace=namespace,
        name=f"cd-{uid}",
        spec=pb.ComputeDomainSpec(num_nodes=num_nodes, channel=pb.ChannelSpec(f"rct-{uid}")),
        created_unix_ms=int(time.time() * 1000),
        source="simulation",
    )
    assert await store.create(store.keys.domain(uid), domain)
    return domain


async def request_deletion(store: Store, uid: str) -> None:
    def mark(current: pb.ComputeDomain | None) -> pb.ComputeDomain | None:
        if current is None:
            return None
        current.deleting = True
        current.deletion_requested_unix_ms = int(time.time() * 1000)
        return current

    await store.update(store.keys.domain(uid), pb.ComputeDomain, mark)


async def domain_status(store: Store, uid: str) -> pb.ComputeDomainStatus | None:
    got = await store.get(store.keys.domain(uid), pb.ComputeDomain)
    return got.value.status if got is not None else None


def ready_reason(status: pb.ComputeDomainStatus | None) -> tuple[str, str, str] | None:
    """(status.status name, Ready condition reason, its message)."""
    if status is None or not status.conditions:
        return None
    cond = status.conditions[0]
    return pb.Readiness(status.status).name, cond.reason, cond.message


@contextlib.asynccontextmanager
async def running_controller(
    etcd_config: EtcdConfig, holder: str = "test-controller", ttl_s: int = 2, **config: float
) -> AsyncIterator[DomainReconciler]:
    store = Store(etcd_config)
    await store.connect()
    reconciler = DomainReconciler(store, ControllerMetrics(), ReconcilerConfig(**config))  # type: ignore[arg-type]
    election = LeaderElection(store, "cd-controller", holder, ttl_s=ttl_s)
    tasks = [asyncio.create_task(reconciler.watch()), asyncio.create_task(election.run(reconciler.lead))]
    try:
        await eventually(lambda: _leading(reconciler), "the controller to lead")
        yield reconciler
    finally:
        stuck = await cancel_until_done(tasks, 10)
        assert not stuck, f"controller tasks did not stop when cancelled: {stuck}"
        record = await store.get(store.keys.election("cd-controller"), pb.LeaderRecord)
        if record is not None and record.lease:
            await store.revoke_lease(record.lease)
        await asyncio.wait_for(store.close(), 10)


async def _leading(reconciler: DomainReconciler) -> bool:
    return reconciler.leading


async def caught_up(store: Store, reconciler: DomainReconciler, timeout_s: float = 10.0) -> int:
    """Wait until the controller applied every store change made so far (the store's revision
    now; the caller's last write must be one the controller watches) and no reconcile is waiting
    or running: whatever it would do about those changes, it has done. Returns the revision.

    What a negative test waits for instead of a fixed sleep."""
    revision = await store.revision()

    async def probe() -> bool:
        return reconciler.view_revision >= revision and reconciler.metrics.queue_depth._value.get() == 0

    await eventually(probe, f"the controller to apply revision {revision} and drain its queue", timeout_s)
    return revision
