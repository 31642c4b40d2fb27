"""Prepare and unprepare of channel claims on this node, and the start-up reconcile: the shell.

What each must do is decided by pure plans in ``services/nodeagent/core/`` (``prepare_plan``,
``unprepare_plan``, ``reconcile_plan``) over what this shell observed: the claim, the checkpoint,
the domain's record and this node's. The shell reads, calls the plan, and applies its steps: the
awaits, the locks and the error mapping live here, the decisions there.

Prepare: resolve the claim, take our driver's allocation on this node, decode the
opaque ComputeDomainChannelConfig strictly, check that the ComputeDomain exists in the claim's
namespace (the security boundary: nothing is written before this check passes), refuse a claim
unprepared moments ago (upstream #1162), then

    checkpoint PrepareStarted -> PreparedClaim PREPARE_STARTED + join the domain
    -> wait for this node's IMEX daemon READY -> CDI spec -> checkpoint PrepareCompleted
    -> PreparedClaim PREPARE_COMPLETED

Every step is idempotent, so a retry after any failure or crash continues where it stopped.
The checkpoint entry comes first: whatever the agent did in the store or on disk, its
checkpoint (or, if that is lost, its PreparedClaim records) says so after a crash.

Unprepare is the reverse, idempotent, and leaves the domain when the node holds no other claim
of it. Join and leave of one domain are serialized per domain on this node, so an unprepare
never leaves a domain that a concurrent prepare has just joined for another claim.

Callers serialize calls per claim (the DRA server holds a lock per claim UID).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import aetcd.exceptions
import structlog

from libs.cdi.spec_dir import ClaimSpecDir
from libs.contract.names import DRIVER_NAME
from libs.gen.computedomain.state import v1 as pb
from libs.hardware.errors import HardwareError
from libs.runtime.errors import PermanentError, RetryableError
from libs.state.codec import UndecodableValue
from libs.state.membership import NodeBusy, join_domain, leave_domain
from libs.state.store import TRANSIENT_ERRORS, Read, Store, StoreFailure
from services.nodeagent.core.checkpoint import Checkpoint, ClaimEntry, StalePrepareError
from services.nodeagent.core.claim import ClaimRef, ClaimSource
from services.nodeagent.core.domain_header import DomainHeader, decode_domain_header
from services.nodeagent.core.errors import ClaimError, ClaimGone, PermanentClaimError, RetryableClaimError
from services.nodeagent.core.prepare_plan import (
    PreparedDevice,
    PreparePlan,
    StartStep,
    admit_claim,
    devices_of,
    finished_answer,
    held_domain,
    membership_held,
    not_ready_message,
    plan_prepare,
    plan_start,
)
from services.nodeagent.core.reconcile_plan import (
    DropRecord,
    RebuildEntry,
    domain_to_leave,
    half_prepared,
    needs_record,
    plan_records,
    record_problem,
    restored_record,
    stale_specs,
)
from services.nodeagent.core.unprepare_plan import UnprepareStep, forget, leaves_domain, plan_unprepare
from services.nodeagent.shell.checkpoint_writer import CheckpointWriter
from services.nodeagent.shell.keyed_locks import KeyedLocks
from services.nodeagent.shell.metrics import AgentMetrics
from services.nodeagent.shell.store_batch import StoreBatch

log = structlog.get_logger(__name__)

T = TypeVar("T")

# A file operation that takes longer (a hung disk) fails the call as retryable.
FILE_IO_TIMEOUT_S = 10.0

DEFAULT_PREPARE_BUDGET_S = 45.0
# More missing channel devices than this are created off the event loop.
_INLINE_CHANNEL_CREATES = 8

# Store failures after which the same call may succeed: kubelet should retry. Ours derive from
# StoreFailure (a RetryableError); aetcd's and asyncio's cannot.
STORE_FAILURES: tuple[type[BaseException], ...] = (
    *TRANSIENT_ERRORS,
    aetcd.exceptions.ClientError,
    StoreFailure,
)


class NodeIdentity(Protocol):
    """This node's record as the IMEX agent registered it in the store (``NodeView`` provides it)."""

    @property
    def node(self) -> pb.Node: ...


class DaemonReadiness(Protocol):
    """This node's IMEX daemons, run by the IMEX agent (``DaemonView`` provides it from the store).

    The IMEX agent acts on membership changes through its own watch: nothing needs telling."""

    async def wait_ready(self, domain_uid: str, timeout_s: float, node_id: int | None = None) -> bool:
        """True once this node's daemon for the domain is READY (as IMEX node `node_id`, when
        given: a READY left from before a rejoin at another index does not count)."""
        ...


class ChannelHardware(Protocol):
    """The part of the hardware port that prepare needs."""

    def imex_channel_major(self) -> int: ...

    def ensure_imex_channel_device(self, channel: int) -> object: ...


@dataclass
class ReconcileReport:
    rebuilt_from_store: list[str] = field(default_factory=list)
    unprepared_gone: list[str] = field(default_factory=list)
    removed_cdi_specs: list[str] = field(default_factory=list)
    dropped_store_records: list[str] = field(default_factory=list)
    left_domains: list[str] = field(default_factory=list)


def _now_ms() -> int:
    return int(time.time() * 1000)


class DeviceState:
    """The claims this node prepared: checkpoint, store records, CDI specs and memberships."""

    def __init__(
        self,
        *,
        store: Store,
        identity: NodeIdentity,
        claims: ClaimSource,
        daemons: DaemonReadiness,
        hardware: ChannelHardware,
        checkpoint: Checkpoint,
        cdi: ClaimSpecDir,
        metrics: AgentMetrics | None = None,
        prepare_budget_s: float = DEFAULT_PREPARE_BUDGET_S,
        checkpoint_fsync: bool = False,
        clock: Callable[[], float] = time.monotonic,
        batch: StoreBatch | None = None,
    ) -> None:
        self.store = store
        self.identity = identity
        self.claims = claims
        self.daemons = daemons
        self.hardware = hardware
        self.checkpoint = checkpoint
        self.cdi = cdi
        self.metrics = metrics if metrics is not None else AgentMetrics()
        self.prepare_budget_s = prepare_budget_s
        # The checkpoint only counts within one boot (its boot id), and a process crash keeps
        # the page cache: a rename alone makes a save survive everything the checkpoint must
        # survive. fsync would only add a disk flush (milliseconds) to every prepare.
        self.checkpoint_fsync = checkpoint_fsync
        self.checkpoint_writer = CheckpointWriter(
            checkpoint, fsync=checkpoint_fsync, timeout_s=FILE_IO_TIMEOUT_S, on_saved=self._saved
        )
        # The hot path's reads and writes of single keys, batched with concurrent calls' own.
        self.batch = batch if batch is not None else StoreBatch(store)
        self._clock = clock
        self._domain_locks = KeyedLocks()
        self._domain_headers: dict[str, tuple[int, DomainHeader | None]] = {}
        self._channel_major: int | None = None
        self._ensured_channels: set[int] = set()
        # Set once the start-up reconcile made the checkpoint the truth about this node's claims.
        self.reconciled = asyncio.Event()

    async def prepare(self, ref: ClaimRef) -> list[PreparedDevice]:
        """Prepare one claim; raises :class:`PermanentClaimError` or :class:`RetryableClaimError`."""
        finished = finished_answer(self.checkpoint.get(ref.uid))
        if finished is not None:
            return finished
        deadline = self._clock() + self.prepare_budget_s
        try:
            return await self._prepare(ref, deadline)
        except ClaimError:
            raise
        except STORE_FAILURES as exc:
            raise RetryableClaimError(f"state store unavailable: {exc or type(exc).__name__}") from exc

    async def _prepare(self, ref: ClaimRef, deadline: float) -> list[PreparedDevice]:
        node = self.identity.node
        # A node takes part in one domain at a time: fetch that domain's record alongside the
        # claim (one round trip for both); a claim naming another domain costs one more read.
        held = self.held_domain()
        if held is not None:
            claim, domain = await asyncio.gather(self.claims.resolve(ref), self._get_domain(held))
        else:
            claim, domain = await self.claims.resolve(ref), None
        request = admit_claim(
            ref, claim, node.name, self.checkpoint.is_tombstoned(ref.uid, claim_version=claim.version)
        )
        if held != request.config.domain_id:
            domain = await self._get_domain(request.config.domain_id)
        plan = plan_prepare(request, domain, node)
        major = self._major() if plan.fabric else None
        record_key = self.store.keys.preparation(node.name, ref.uid)
        async with self._domain_locks.hold(plan.domain_uid):
            held_by_other = membership_held(
                self.checkpoint.entries.values(), plan.domain_uid, besides=ref.uid
            )
            step = plan_start(plan, self.checkpoint.get(ref.uid), held_by_other)
            joined_now, index = await self._start(plan, step, record_key, node)
        bound = log.bind(claim_uid=ref.uid, namespace=ref.namespace, cd_uid=plan.domain_uid, node=node.name)
        if joined_now:
            bound.info("prepare: node joined domain")
        if plan.fabric:
            await self._wait_for_daemon(plan, index, deadline)
            await self._ensure_channels(plan.channels)
        entry = await self._complete(plan, record_key, major)
        bound.info(
            "claim prepared",
            mode=request.config.allocation_mode,
            channels=len(plan.channels),
            cdi_device_id=plan.cdi_device_id,
        )
        return devices_of(entry)

    async def _start(
        self, plan: PreparePlan, step: StartStep, record_key: str, node: pb.Node
    ) -> tuple[bool, int | None]:
        """Record the prepare as started and join as ``step`` says: (joined now, IMEX node index
        when joined). The caller holds the domain lock."""
        try:
            if step is StartStep.RIDE_ALONG:
                self.checkpoint.apply(plan.start)  # saved with the completion (see StartStep)
                return False, None
            await self._update_checkpoint(plan.start)
        except StalePrepareError as exc:
            raise PermanentClaimError(str(exc)) from None
        put = asyncio.ensure_future(self.store.put(record_key, plan.started_record(_now_ms())))
        try:
            return await self._join(plan.domain_uid, plan.request.ref.namespace, node)
        finally:
            await put

    async def _wait_for_daemon(self, plan: PreparePlan, index: int | None, deadline: float) -> None:
        remaining = max(deadline - self._clock(), 0.0)
        if not await self.daemons.wait_ready(plan.domain_uid, remaining, node_id=index):
            raise RetryableClaimError(await self._not_ready_message(plan.domain_uid, plan.node_name))

    async def _complete(self, plan: PreparePlan, record_key: str, major: int | None) -> ClaimEntry:
        """CDI spec, checkpoint PrepareCompleted and PreparedClaim PREPARE_COMPLETED; on failure the
        record says started again."""
        uid = plan.request.ref.uid
        # The store write travels while the local files are written. Should the agent die in
        # between, the reconcile at start settles it: a completed record whose spec exists is
        # taken as completed, one without its spec as started.
        put = asyncio.ensure_future(self.batch.put(record_key, plan.completed_record(_now_ms())))
        try:
            # On the loop, as the checkpoint below: a small write and a rename, no fsync; a hop to
            # the shared thread pool waited behind every other blocking call of the process.
            self.cdi.write(uid, channels=plan.channels, major=major)
            entry = await self._update_checkpoint(plan.complete)
        except BaseException as exc:
            await self._revert_completed_record(put, record_key, plan.started_record(_now_ms()))
            if isinstance(exc, StalePrepareError):  # unprepared meanwhile: do not resurrect it
                self.cdi.remove(uid)
                raise PermanentClaimError(str(exc)) from None
            if isinstance(exc, OSError):
                raise RetryableClaimError(
                    f"cannot write CDI spec or checkpoint for claim {uid}: {exc}"
                ) from exc
            raise
        await put
        return entry

    async def _revert_completed_record(
        self, put: asyncio.Future[int], key: str, started: pb.PreparedClaim
    ) -> None:
        """The local half of a prepare failed after its completed record was sent: say started."""
        with contextlib.suppress(*STORE_FAILURES):
            await put
        with contextlib.suppress(*STORE_FAILURES):
            await self.store.put(key, started)

    def held_domain(self) -> str | None:
        """The domain of this node's completed claims, if any (see ``core/prepare_plan.py``)."""
        return held_domain(self.checkpoint.entries.values())

    async def _get_domain(self, domain_uid: str) -> DomainHeader | None:
        key = self.store.keys.domain(domain_uid)
        found = await self.batch.get(key)
        if found is None:
            return None
        # Read on every prepare (the check must see the record as it is now); decoded again
        # only when it changed since the last prepare.
        cached = self._domain_headers.get(key)
        if cached is not None and cached[0] == found.mod_revision:
            return cached[1]
        header = decode_domain_header(found.value, key)
        self._domain_headers = {key: (found.mod_revision, header)}  # the node's one domain
        return header

    async def _join(self, domain_uid: str, namespace: str, node: pb.Node) -> tuple[bool, int]:
        """Make this node an active member: (joined now, its index). One read when it already is
        (`join_domain`'s first read sees the active member and returns it)."""
        try:
            result = await join_domain(self.store, domain_uid, namespace, node)
        except NodeBusy as exc:
            raise RetryableClaimError(f"node busy: {exc}") from None
        except StoreFailure:
            raise  # the caller's "state store unavailable"
        except (RetryableError, PermanentError) as exc:
            # A refused join (the clique is full, the domain is going) may succeed later; an
            # index conflict or an unreadable record waits for the controller or a rewrite,
            # and kubelet retries every failure: all retryable for the claim.
            raise RetryableClaimError(str(exc)) from None
        return result.joined_now, result.member.index

    async def _not_ready_message(self, domain_uid: str, node_name: str) -> str:
        try:
            status = await self.store.get(self.store.keys.daemon(domain_uid, node_name), pb.DaemonStatus)
        except STORE_FAILURES:
            return not_ready_message(domain_uid, node_name, self.prepare_budget_s, None, read=False)
        value = None if status is None else status.value
        return not_ready_message(domain_uid, node_name, self.prepare_budget_s, value)

    def _major(self) -> int:
        if self._channel_major is None:
            try:
                self._channel_major = self.hardware.imex_channel_major()
            except HardwareError as exc:
                raise RetryableClaimError(f"IMEX channels unavailable on this node: {exc}") from exc
        return self._channel_major

    async def _ensure_channels(self, channels: Sequence[int]) -> None:
        """Create missing channel device nodes on the host, once per channel per process."""
        missing = [c for c in channels if c not in self._ensured_channels]
        if not missing:
            return
        try:
            if len(missing) > _INLINE_CHANNEL_CREATES:
                # allocationMode All: 2048 nodes take seconds on a slow disk; keep serving meanwhile.
                await asyncio.to_thread(self._create_channels, missing)
            else:
                self._create_channels(missing)
        except (OSError, HardwareError) as exc:
            raise RetryableClaimError(f"cannot create IMEX channel device: {exc}") from exc

    def _create_channels(self, channels: Sequence[int]) -> None:
        for channel in channels:
            self.hardware.ensure_imex_channel_device(channel)
            self._ensured_channels.add(channel)

    def _update_checkpoint(self, mutate: Callable[[Checkpoint], T]) -> Coroutine[Any, Any, T]:
        """Change the checkpoint now (``mutate``) and return what to await for its save: it gives
        ``mutate``'s result once the change is in the file, or raises :class:`RetryableClaimError`
        with the change undone (concurrent changes share writes; see ``checkpoint_writer``)."""
        return _checkpoint_written(self.checkpoint_writer.update(mutate))

    def _saved(self) -> None:
        self.metrics.prepared_claims.set(len(self.checkpoint.entries))

    async def unprepare(self, ref: ClaimRef) -> None:
        """Release one claim; unknown claims succeed. Raises :class:`RetryableClaimError`."""
        try:
            await self._unprepare(ref.uid, ref.namespace)
        except ClaimError:
            raise
        except STORE_FAILURES as exc:
            raise RetryableClaimError(f"state store unavailable: {exc or type(exc).__name__}") from exc
        except OSError as exc:
            raise RetryableClaimError(f"cannot remove CDI spec of claim {ref.uid}: {exc}") from exc

    async def _unprepare(self, claim_uid: str, namespace: str) -> None:
        try:
            self.cdi.remove(claim_uid)
        except ValueError:  # not a valid UID: we never wrote anything for it
            return
        entry = self.checkpoint.get(claim_uid)
        step = plan_unprepare(entry, claim_uid in self.checkpoint.tombstones)
        if step is UnprepareStep.DELETE_RECORD:
            # Unprepared before; a retry after a failed store delete finishes it.
            await self.store.delete(self.store.keys.preparation(self.identity.node.name, claim_uid))
        elif step is UnprepareStep.TOMBSTONE:
            await self._update_checkpoint(forget(claim_uid))
        elif entry is not None and step is UnprepareStep.FORGET_MIGRATED:
            await self._update_checkpoint(forget(claim_uid))
            log.info(
                "claim unprepared",
                claim_uid=claim_uid,
                namespace=entry.namespace,
                migrated_from=entry.migrated_from,
            )
        elif entry is not None:
            await self._release(entry)

    async def _release(self, entry: ClaimEntry) -> None:
        """Unprepare a claim of a domain: the last one of the domain on this node leaves it."""
        claim_uid = entry.claim_uid
        node = entry.node or self.identity.node.name
        record_key = self.store.keys.preparation(node, claim_uid)
        removed: Coroutine[Any, Any, ClaimEntry | None] | None = None
        async with self._domain_locks.hold(entry.domain_uid):
            if leaves_domain(self.checkpoint.entries.values(), entry):
                await self.store.delete(record_key)
                if await leave_domain(self.store, entry.domain_uid, node):
                    log.info("unprepare: node left domain", cd_uid=entry.domain_uid, node=entry.node)
                await self._update_checkpoint(forget(claim_uid))
            else:
                # Decided and recorded here, under the lock; the writes below need no lock, so
                # unprepares of a domain do not queue behind each other's round trips.
                removed = self._update_checkpoint(forget(claim_uid))
        if removed is not None:
            # The store delete travels while the checkpoint is written (if the delete fails,
            # the retry finds the tombstone and deletes; if the write fails, the retry finds
            # the entry and unprepares again).
            delete = asyncio.ensure_future(self.batch.delete(record_key))
            try:
                await removed
            finally:
                await delete
        log.info("claim unprepared", claim_uid=claim_uid, namespace=entry.namespace, cd_uid=entry.domain_uid)

    async def reconcile(self) -> ReconcileReport:
        """Bring checkpoint, store records, CDI directory and memberships into agreement.

        Run once at start, before serving kubelet. Store records this checkpoint lacks (it was
        corrupt, or the node rebooted) are taken back; half-prepared claims whose claim is gone
        are unprepared; CDI specs of claims we do not hold are removed; a membership without a
        held claim is left. When everything already agrees nothing is written: a plugin restart
        or upgrade changes nothing in the store. A membership the controller marked LOST is not
        touched: the controller makes it ACTIVE again (same index) once the node record is back,
        which is the IMEX agent's to keep, not the plugin's.
        """
        report = ReconcileReport()
        node_name = self.identity.node.name
        self.cdi.remove_stale_temps()
        records, _ = await self.store.list(self.store.keys.preparations(node_name), pb.PreparedClaim)
        on_disk = set(self.cdi.claim_uids())
        items = [(item.key, item.value) for item in records]
        for step in plan_records(items, self.checkpoint.entries, self.checkpoint.tombstones, on_disk):
            if isinstance(step, DropRecord):
                await self.store.delete(step.key)  # unprepared; the record outlived a crash
                report.dropped_store_records.append(step.claim_uid)
            else:
                await self._rebuild_entry(step)
                report.rebuilt_from_store.append(step.record.claim_uid)
        if report.rebuilt_from_store:
            log.warning("checkpoint rebuilt from the store", node=node_name, claims=report.rebuilt_from_store)

        for entry in half_prepared(list(self.checkpoint.entries.values())):
            try:
                await self.claims.resolve(ClaimRef(entry.namespace, entry.name, entry.claim_uid))
            except ClaimGone:
                log.info("reconcile: half-prepared claim is gone; unpreparing", claim_uid=entry.claim_uid)
                await self._unprepare(entry.claim_uid, entry.namespace)
                report.unprepared_gone.append(entry.claim_uid)
            except ClaimError as exc:
                log.warning(
                    "reconcile: cannot check half-prepared claim", claim_uid=entry.claim_uid, error=str(exc)
                )

        for uid in stale_specs(self.cdi.claim_uids(), self.checkpoint.entries):
            self.cdi.remove(uid)
            report.removed_cdi_specs.append(uid)

        binding = await self.store.get(self.store.keys.node_binding(node_name), pb.NodeBinding)
        bound = None if binding is None else binding.value.domain_uid
        leave = domain_to_leave(bound, self.checkpoint.entries.values())
        if leave is not None:
            await leave_domain(self.store, leave, node_name)
            report.left_domains.append(leave)
        for action in ("rebuilt_from_store", "unprepared_gone", "removed_cdi_specs", "left_domains"):
            count = len(getattr(report, action))
            if count:
                self.metrics.reconciled.labels(action=action).inc(count)
        self.metrics.prepared_claims.set(len(self.checkpoint.entries))
        log.info("reconcile done", node=node_name, **{k: v for k, v in vars(report).items() if v})
        self.reconciled.set()
        return report

    async def _rebuild_entry(self, step: RebuildEntry) -> None:
        request_names: tuple[str, ...] | None = None
        if step.wants_request_names:
            prep = step.record
            try:
                claim = await self.claims.resolve(ClaimRef(prep.namespace, prep.name, prep.claim_uid))
                request_names = tuple(r.request for r in claim.results_for(DRIVER_NAME, prep.node_name))
            except ClaimError:
                pass  # gone or unreachable: stays PrepareStarted, handled below or by kubelet
        await self._update_checkpoint(lambda checkpoint: step.rebuild(checkpoint, request_names))

    async def restore_record(self, claim_uid: str) -> str | None:
        """Write a held claim's PreparedClaim again if the store lost it (deleted, undecodable,
        or naming another domain or node); what was wrong, None if nothing was written.

        The checkpoint is the truth about this node's claims; without the record the controller
        would release a returning LOST member and its index. Decided under the claim's domain
        lock, so a concurrent unprepare (which deletes the record) is never undone, and written
        only over the value that was read, so a prepare's own write meanwhile (its completed
        record travels outside that lock) is never overwritten. A record whose claim is gone from
        the claim source (the controller dropped it with its claim) is not written again: the
        claim is unprepared here instead."""
        entry = self.checkpoint.get(claim_uid)
        if not needs_record(entry):
            return None
        gone = ""
        async with self._domain_locks.hold(entry.domain_uid):
            entry = self.checkpoint.get(claim_uid)
            if entry is None or not entry.domain_uid:
                return None
            node = entry.node or self.identity.node.name
            key = self.store.keys.preparation(node, claim_uid)
            (found,) = (await self.store.txn([], [Read(key)])).reads
            read_at = found[0].mod_revision if found else 0
            problem: str | None
            try:
                item = self.store.decode_kv(found[0], pb.PreparedClaim, strict=True) if found else None
            except UndecodableValue as exc:
                problem = f"was overwritten with an undecodable value ({exc.reason})"
            else:
                problem = record_problem(entry, node, None if item is None else item.value)
                if problem is None:
                    return None
            gone = await self._claim_gone(entry.namespace, entry.name, claim_uid)
            if not gone:
                written = await self.store.compare_and_swap(
                    key, restored_record(entry, node, _now_ms()), read_at
                )
                return problem if written else None
        # The controller drops a lost node's records whose claims the API server no longer has
        # (and releases the member): writing one back would have this node hold a claim of a
        # domain it left. Unprepared here instead (outside the lock, which unprepare takes).
        log.warning(
            "prepared claim record gone with its claim; unpreparing instead of writing it again",
            claim_uid=claim_uid,
            cd_uid=entry.domain_uid,
            node=self.identity.node.name,
            reason=gone,
        )
        await self._unprepare(claim_uid, entry.namespace)
        return None

    async def _claim_gone(self, namespace: str, name: str, claim_uid: str) -> str:
        """Why the claim is gone from its source ("" when it is there or cannot be asked now)."""
        try:
            await self.claims.resolve(ClaimRef(namespace, name, claim_uid))
        except ClaimGone as exc:
            return str(exc)
        except ClaimError:
            return ""  # unreachable or unusable: the checkpoint stays the truth
        return ""


async def _checkpoint_written(written: Awaitable[T]) -> T:
    """The result of a checkpoint update once written; a failed write is retryable for the claim."""
    try:
        return await written
    except (OSError, TimeoutError) as exc:
        raise RetryableClaimError(f"cannot write the checkpoint: {exc or 'timed out'}") from exc
