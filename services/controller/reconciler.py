"""The controller's async shell: watches feed the view, a work queue feeds reconciles.

Five watches (domains, members, daemon statuses, node records, prepared
claims) keep a `StoreView` current in every replica. While leader, each
affected domain uid is queued (deduplicated) and workers reconcile it: the
pure core (`plan.py`) decides the status and actions, and every write is one
etcd transaction carrying the leader fence, so a deposed leader's writes fail.
A node-record delete event queues its domains at once, and so does every
daemon status: node loss shows as soon as etcd has expired the IMEX side's
lease and no peer's daemon reports the node connected any more.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import betterproto
import structlog

from libs.gen.computedomain.state import v1 as pb
from libs.runtime.cancellation import run_all
from libs.runtime.errors import PermanentError
from libs.state.codec import UndecodableValue, decode
from libs.state.domain_record import DomainRecord
from libs.state.election import Leadership
from libs.state.membership import activate_member, mark_member_lost
from libs.state.store import Absent, Compare, Delete, Op, Put, Read, Store, Unchanged
from libs.state.watch import Resync, WatchEvent, watch_prefix
from services.controller.actions import (
    Action,
    ActivateMember,
    DeleteDaemonStatus,
    DeleteDomain,
    DeleteMeshCredentials,
    DeletePreparation,
    MarkMemberLost,
    ReleaseMember,
    SecureMesh,
    SignMeshCertificate,
)
from services.controller.mesh_signer import MeshSigner
from services.controller.metrics import ControllerMetrics
from services.controller.plan import plan_domain
from services.controller.status_model import StatusValue, encode_status
from services.controller.view import StoreView
from services.controller.workqueue import QueueShutDown, WorkQueue

log = structlog.get_logger(__name__)

M = TypeVar("M", bound=betterproto.Message)

# Called with a domain uid whenever that domain's record changes in the view (Kubernetes adapter).
DomainListener = Callable[[str], None]


@dataclass(frozen=True)
class ReconcilerConfig:
    workers: int = 4
    # Records of a missing domain (a join racing the teardown) are released after this long.
    orphan_grace_s: float = 30.0
    # Every domain is queued again this often (level-triggered safety net).
    resync_period_s: float = 300.0
    # Deadline of one reconcile (all its store calls).
    reconcile_timeout_s: float = 30.0
    # Share of the time one domain may keep a worker busy (see workqueue.py: pacing).
    busy_share: float = 0.25
    # Mode of newly seen domains: mutual TLS between their IMEX daemons (else plaintext).
    mesh_tls: bool = True
    # Lifetime of a node's mesh certificate (its IMEX agent renews at two thirds) and of a CA.
    mesh_certificate_validity_s: float = 24 * 3600.0
    mesh_authority_validity_s: float = 366 * 24 * 3600.0


_WATCHED_RESOURCES = 8


class FenceLost(PermanentError, RuntimeError):
    """A fenced write failed on the fence: this replica is no longer the leader. Permanent: only a
    new term may write again."""


class DomainReconciler:
    def __init__(
        self,
        store: Store,
        metrics: ControllerMetrics | None = None,
        config: ReconcilerConfig | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.keys = store.keys
        self.metrics = metrics or ControllerMetrics()
        self.config = config or ReconcilerConfig()
        self.clock = clock
        self.view = StoreView(store.keys)
        self.mesh_signer = MeshSigner(
            store,
            self.view,
            certificate_validity_s=self.config.mesh_certificate_validity_s,
            authority_validity_s=self.config.mesh_authority_validity_s,
            clock=clock,
        )
        self.queue: WorkQueue[str] = WorkQueue(busy_share=self.config.busy_share)
        # Seconds of computing of the reconcile that just ran, per domain (read by its worker).
        self._compute_s: dict[str, float] = {}
        self.synced = asyncio.Event()
        self.listeners: list[DomainListener] = []
        self._leadership: Leadership | None = None
        self._synced_resources: set[str] = set()
        self.view_revision = 0
        self.metrics.track_domains(self.domain_counts)
        # Queued plus in progress: zero means the controller has nothing left to do.
        self.metrics.track_queue(lambda: len(self.queue) + self.queue.processing)

    # ---- observation ------------------------------------------------------------------

    def domain_counts(self) -> dict[str, int]:
        counts: Counter[str] = Counter()
        for entry in self.view.domains.values():
            if entry.value.deleting:
                counts["Terminating"] += 1
            elif entry.status.ready:
                counts["Ready"] += 1
            else:
                counts["NotReady"] += 1
        return dict(counts)

    @property
    def leading(self) -> bool:
        return self._leadership is not None

    async def watch(self) -> None:
        """Keep the view current; runs for the life of the process (leader or not)."""
        k = self.keys
        # Not a TaskGroup: a watch task may survive one cancel() (see cancellation.py).
        await run_all(
            self._consume("domains", k.domains(), DomainRecord, self._apply_domains),
            self._consume("members", k.all_members(), pb.Member, self.view.apply_members),
            self._consume("daemons", k.all_daemons(), pb.DaemonStatus, self.view.apply_daemons),
            self._consume("nodes", k.nodes(), pb.Node, self.view.apply_nodes),
            self._consume(
                "preparations", k.all_preparations(), pb.PreparedClaim, self.view.apply_preparations
            ),
            self._consume(
                "meshauthorities", k.mesh_authorities(), pb.MeshAuthority, self.view.mesh.apply_authorities
            ),
            self._consume(
                "meshrequests",
                k.all_mesh_requests(),
                pb.MeshCertificateRequest,
                self.view.mesh.apply_requests,
            ),
            self._consume(
                "meshcertificates",
                k.all_mesh_certificates(),
                pb.MeshCertificate,
                self.view.mesh.apply_certificates,
            ),
        )

    def _apply_domains(self, event: WatchEvent[DomainRecord] | Resync[DomainRecord]) -> set[str]:
        affected = self.view.apply_domains(event)
        for uid in affected:
            for listener in self.listeners:
                listener(uid)
        return affected

    async def _consume(
        self,
        resource: str,
        prefix: str,
        cls: type[M],
        apply: Callable[[WatchEvent[M] | Resync[M]], set[str]],
    ) -> None:
        counter = self.metrics.store_events.labels(resource=resource)
        async for event in watch_prefix(self.store, prefix, cls):
            affected = apply(event)
            if event.revision > self.view_revision:
                self.view_revision = event.revision
                self.metrics.view_revision.set(event.revision)
            if isinstance(event, Resync):
                log.info("view resynced", resource=resource, items=len(event.items), revision=event.revision)
                self._synced_resources.add(resource)
                if len(self._synced_resources) == _WATCHED_RESOURCES:
                    self.synced.set()
            else:
                counter.inc()
                if event.kind == "undecodable":
                    # The view drops the key (as a listing would); an operator should know.
                    self.metrics.undecodable_values.labels(resource=resource).inc()
            if self._leadership is not None:
                for uid in affected:
                    self.queue.add(uid)

    # ---- leading ------------------------------------------------------------------------

    async def lead(self, leadership: Leadership) -> None:
        """Reconcile while leader; cancelled when leadership is lost."""
        await self.synced.wait()
        self._leadership = leadership
        self.queue.clear()
        try:
            for uid in self.view.all_uids():
                self.queue.add(uid)
            async with asyncio.TaskGroup() as tg:
                for i in range(self.config.workers):
                    tg.create_task(self._worker(leadership), name=f"reconcile-worker-{i}")
                tg.create_task(self._periodic_resync())
        finally:
            self._leadership = None
            self.queue.clear()

    async def _periodic_resync(self) -> None:
        while True:
            await asyncio.sleep(self.config.resync_period_s)
            for uid in self.view.all_uids():
                self.queue.add(uid)

    async def _worker(self, leadership: Leadership) -> None:
        while True:
            try:
                uid = await self.queue.get()
            except QueueShutDown:
                return
            started = time.perf_counter()
            try:
                # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation
                # that races the inner call's completion, and the worker would never stop.
                async with asyncio.timeout(self.config.reconcile_timeout_s):
                    recheck_s = await self.reconcile(uid, leadership)
            except FenceLost:
                self.queue.done(uid)
                raise
            except asyncio.CancelledError:
                self.queue.done(uid)
                raise
            except Exception as exc:
                self.metrics.reconcile_errors.inc()
                delay = self.queue.backoff.when(uid)
                log.warning(
                    "reconcile failed; requeued",
                    cd_uid=uid,
                    error=str(exc) or type(exc).__name__,
                    retry_in_s=round(delay, 3),
                )
                self.queue.done(uid)
                self.queue.add_after(uid, delay)
            else:
                self.queue.forget(uid)
                self.queue.done(uid, self._compute_s.pop(uid, 0.0))
                if recheck_s is not None:
                    self.queue.add_after(uid, recheck_s)
            finally:
                self._compute_s.pop(uid, None)
                self.metrics.reconciles.inc()
                self.metrics.reconcile_seconds.observe(time.perf_counter() - started)

    # ---- one reconcile ------------------------------------------------------------------

    async def reconcile(self, uid: str, leadership: Leadership) -> float | None:
        """Bring one domain's status and records in line; returns seconds until a recheck is due."""
        now_ms = int(self.clock() * 1000)
        started = time.perf_counter()
        obs = self.view.observe(uid)
        plan = plan_domain(obs, now_ms, int(self.config.orphan_grace_s * 1000), self.config.mesh_tls)
        encoded = encode_status(plan.status) if plan.status is not None else None
        # The computing this domain costs (no awaits in it): what the work queue paces by.
        self._compute_s[uid] = time.perf_counter() - started
        rewritten = False
        for action in plan.actions:
            applied = await self._apply(uid, action, leadership)
            self.metrics.actions.labels(
                action=type(action).__name__, result="applied" if applied else "skipped"
            ).inc()
            rewritten |= applied and isinstance(action, SecureMesh)
        if rewritten:
            # The domain record moved on under the planned status: plan again at once rather than
            # fail the status write on its revision (and wait out the conflict backoff).
            self.queue.add(uid)
        elif plan.status is not None and encoded is not None and obs.domain is not None:
            await self._write_status(
                uid, obs.domain, obs.domain_revision, obs.status, plan.status, encoded, leadership
            )
        return plan.recheck_after_ms / 1000 if plan.recheck_after_ms is not None else None

    async def _fenced_txn(
        self, compares: list[Compare], ops: list[Op], leadership: Leadership
    ) -> tuple[bool, int]:
        result = await self.store.txn([leadership.fence, *compares], ops)
        if not result.succeeded:
            # Tell a lost fence apart from a lost race: the former ends this term.
            await self._check_fence(leadership)
        return result.succeeded, result.revision

    async def _write_status(
        self,
        uid: str,
        domain: DomainRecord,
        revision: int,
        previous: StatusValue,
        status: StatusValue,
        encoded: bytes,
        leadership: Leadership,
    ) -> None:
        key = self.keys.domain(uid)
        updated = dataclasses.replace(domain, status=encoded)
        ok, new_revision = await self._fenced_txn([Unchanged(key, revision)], [Put(key, updated)], leadership)
        if not ok:
            # The record changed since the view saw it; try again once its watch event is in.
            self.metrics.status_conflicts.inc()
            self.queue.add_rate_limited(uid)
            return
        self.view.put_domain(uid, updated, new_revision, status)
        for listener in self.listeners:
            listener(uid)
        self.metrics.status_writes.inc()
        before, after = previous.conditions[:1], status.conditions[:1]
        transition = previous.ready != status.ready or [c.reason for c in before] != [c.reason for c in after]
        # Transitions at info; a node list that merely grew or shrank at debug (that is most writes).
        (log.info if transition else log.debug)(
            "domain status",
            cd_uid=uid,
            cd=domain.name,
            namespace=domain.namespace,
            status="Ready" if status.ready else "NotReady",
            reason=after[0].reason if after else "",
            message=after[0].message if after else "",
            nodes=len(status.nodes),
        )

    async def _apply(self, uid: str, action: Action, leadership: Leadership) -> bool:
        k = self.keys
        if isinstance(action, MarkMemberLost):
            # The Absent compare makes the decision safe even if the node watch lags the member watch;
            # the peers' reports as read, even if a peer's "still connected" is on its way.
            compares: list[Compare] = [leadership.fence, Absent(k.node(action.node))]
            compares += [Unchanged(k.daemon(uid, peer), rev) for peer, rev in action.peer_reports]
            applied = await mark_member_lost(self.store, uid, action.node, extra_compares=compares)
            if not applied:
                await self._check_fence(leadership)
            return applied
        if isinstance(action, ActivateMember):
            compares = [leadership.fence]
            if action.claims:
                held = await self._claim_held(uid, action)
                if held is None:
                    return False  # its claims went meanwhile: it is released instead
                compares.append(held)
            applied = await activate_member(self.store, uid, action.node, action.mod_revision, compares)
            if applied:
                log.info("member activated", cd_uid=uid, node=action.node, why=action.why)
            else:
                await self._check_fence(leadership)
            return applied
        if isinstance(action, ReleaseMember):
            return await self._release_member(uid, action, leadership)
        if isinstance(action, DeletePreparation):
            ok, _ = await self._fenced_txn(
                [Absent(k.node(action.node))],
                [Delete(k.preparation(action.node, action.claim_uid))],
                leadership,
            )
            if ok:
                log.info(
                    "dropped prepared claim of a lost node",
                    cd_uid=uid,
                    node=action.node,
                    claim_uid=action.claim_uid,
                )
            return ok
        if isinstance(action, DeleteDaemonStatus):
            ok, _ = await self._fenced_txn(
                [Absent(k.member(uid, action.node))], [Delete(k.daemon(uid, action.node))], leadership
            )
            return ok
        if isinstance(action, DeleteDomain):
            ok, _ = await self._fenced_txn(
                # The plan saw no member, but each resource has its own watch: a join the members
                # watch has not shown yet must fail the deletion, not be orphaned by it.
                [Unchanged(k.domain(uid), action.domain_revision), Absent(k.members(uid), prefix=True)],
                [
                    Delete(k.domain(uid)),
                    Delete(k.daemons(uid), prefix=True),
                    Delete(k.member_indices(uid), prefix=True),
                    Delete(k.mesh_authority(uid)),
                    Delete(k.mesh_requests(uid), prefix=True),
                    Delete(k.mesh_certificates(uid), prefix=True),
                ],
                leadership,
            )
            if ok:
                self.mesh_signer.forget(uid)
                log.info("domain torn down", cd_uid=uid)
            else:
                await self._remove_undecodable_members(uid, leadership)
            return ok
        if isinstance(action, SecureMesh | SignMeshCertificate | DeleteMeshCredentials):
            return await self.mesh_signer.apply(uid, action, leadership, self._fenced_txn)
        raise TypeError(f"unknown action {action!r}")

    async def _remove_undecodable_members(self, uid: str, leadership: Leadership) -> None:
        """A value no version of us can read under the members of a deleted domain would hold its
        record forever (the teardown compares that no member is left; the view, and so the plan,
        never shows such a value). When nothing else is left there, remove it, logged with its key."""
        prefix = self.keys.members(uid)
        result = await self.store.txn([], [Read(prefix, prefix=True)])
        kvs = result.reads[0] if result.reads else []
        unreadable = []
        for kv in kvs:
            try:
                decode(kv.value, pb.Member, kv.key)
            except UndecodableValue as exc:
                unreadable.append((kv, exc.reason))
        if not unreadable or len(unreadable) < len(kvs):
            return  # a real member the view has not shown yet: the plan waits for it
        ok, _ = await self._fenced_txn(
            [Unchanged(kv.key, kv.mod_revision) for kv, _ in unreadable],
            [Delete(kv.key) for kv, _ in unreadable],
            leadership,
        )
        if ok:
            for kv, reason in unreadable:
                log.warning(
                    "undecodable member value of a deleted domain removed",
                    cd_uid=uid,
                    key=kv.key,
                    reason=reason,
                )

    async def _claim_held(self, uid: str, action: ActivateMember) -> Compare | None:
        """A compare that one of the claims the decision saw is still prepared for this domain."""
        for claim in action.claims:
            got = await self.store.get(self.keys.preparation(action.node, claim), pb.PreparedClaim)
            if got is not None and got.value.domain_uid == uid:
                return Unchanged(got.key, got.mod_revision)
        return None

    async def _check_fence(self, leadership: Leadership) -> None:
        leader = await self.store.get(leadership.key, pb.LeaderRecord)
        if leader is None or leader.create_revision != leadership.create_revision:
            raise FenceLost(f"leadership of {leadership.holder} was lost")

    async def _release_member(self, uid: str, action: ReleaseMember, leadership: Leadership) -> bool:
        k = self.keys
        member_key = k.member(uid, action.node)
        binding_key = k.node_binding(action.node)
        binding = await self.store.get(binding_key, pb.NodeBinding)
        compares: list[Compare] = [Unchanged(member_key, action.mod_revision)]
        if action.orphan:
            compares.append(Absent(k.domain(uid)))
        ops: list[Op] = [
            Delete(member_key),
            Delete(k.daemon(uid, action.node)),
            Delete(k.mesh_request(uid, action.node)),
            Delete(k.mesh_certificate(uid, action.node)),
        ]
        if binding is not None and binding.value.domain_uid == uid:
            compares.append(Unchanged(binding_key, binding.mod_revision))
            ops.append(Delete(binding_key))
        if action.index >= 0 and action.clique_id:
            ops.append(Delete(k.member_index(uid, action.clique_id, action.index)))
        ok, _ = await self._fenced_txn(compares, ops, leadership)
        if ok:
            log.info("member released", cd_uid=uid, node=action.node, clique=action.clique_id, why=action.why)
        return ok
