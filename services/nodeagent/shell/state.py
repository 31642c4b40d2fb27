"""Prepare and unprepare of channel claims on this node, and the start-up reconcile.

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

from libs.cdi.spec import channels_for, claim_cdi_device_id
from libs.cdi.specdir import ClaimSpecDir
from libs.contract.channelconfig import ChannelConfig, ConfigError, decode_channel_config
from libs.contract.names import CHANNEL_DEVICE, DRIVER_NAME, REASON_DRIVER_TOO_OLD
from libs.gen.computedomain.state import v1 as pb
from libs.hardware.errors import HardwareError
from libs.runtime.errors import PermanentError, RetryableError
from libs.state.codec import UndecodableValue
from libs.state.membership import (
    NodeBusy,
    join_domain,
    leave_domain,
)
from libs.state.store import TRANSIENT_ERRORS, Read, Store, StoreFailure
from services.nodeagent.core.checkpoint import Checkpoint, ClaimEntry, ClaimState, StalePrepareError
from services.nodeagent.core.claim import ClaimRef, ResolvedClaim
from services.nodeagent.core.domainheader import DomainHeader, decode_domain_header
from services.nodeagent.core.errors import ClaimError, ClaimGone, PermanentClaimError, RetryableClaimError
from services.nodeagent.shell.checkpointwriter import CheckpointWriter
from services.nodeagent.shell.keyedlocks import KeyedLocks
from services.nodeagent.shell.metrics import AgentMetrics
from services.nodeagent.shell.storebatch import StoreBatch
from services.nodeagent.wire.claimsource import ClaimSource

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


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """One entry of a NodePrepareResources answer, independent of the API version."""

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]


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

    # ---- prepare ---------------------------------------------------------------------------

    async def prepare(self, ref: ClaimRef) -> list[PreparedDevice]:
        """Prepare one claim; raises :class:`PermanentClaimError` or :class:`RetryableClaimError`."""
        entry = self.checkpoint.get(ref.uid)
        if entry is not None and entry.state is ClaimState.PREPARE_COMPLETED:
            return self._devices_of(entry)  # repeat of a finished prepare: no side effects
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
        results = claim.results_for(DRIVER_NAME, node.name)
        if not results:
            raise PermanentClaimError(
                f"claim {ref.namespace}/{ref.name} has no device of driver {DRIVER_NAME} allocated on node {node.name}"
            )
        for result in results:
            if result.device != CHANNEL_DEVICE:
                raise PermanentClaimError(
                    f"claim {ref.namespace}/{ref.name} was allocated unknown device {result.device!r} "
                    f"of driver {DRIVER_NAME} (this node offers {CHANNEL_DEVICE})"
                )
        config = self._channel_config(claim, [r.request for r in results])
        if self.checkpoint.is_tombstoned(ref.uid, claim_version=claim.version):
            raise PermanentClaimError(
                f"claim {ref.namespace}/{ref.name} ({ref.uid}) was unprepared recently; "
                "refusing a stale prepare"
            )
        if held != config.domain_id:
            domain = await self._get_domain(config.domain_id)
        _check_domain(ref, config, domain)  # the security boundary: nothing was written so far
        fabric = bool(node.clique_id)
        if not fabric and node.fabric_message:
            raise RetryableClaimError(f"node {node.name}: NVLink clique not known yet: {node.fabric_message}")
        channels = channels_for(config.allocation_mode, fabric=fabric)
        major = self._major() if fabric else None
        record_key = self.store.keys.preparation(node.name, ref.uid)

        def started_record() -> pb.PreparedClaim:  # built only when written (a join, a revert)
            return pb.PreparedClaim(
                claim_uid=ref.uid,
                namespace=ref.namespace,
                name=ref.name,
                node_name=node.name,
                domain_uid=config.domain_id,
                state=pb.PreparedState.PREPARE_STARTED,
                updated_unix_ms=_now_ms(),
            )

        async with self._domain_locks.hold(config.domain_id):
            existing = self.checkpoint.get(ref.uid)
            # A claim taken over from NVIDIA's checkpoint without a known domain takes the claim's.
            if existing is not None and existing.domain_uid and existing.domain_uid != config.domain_id:
                raise PermanentClaimError(
                    f"claim {ref.uid} was started for domain {existing.domain_uid}, now names {config.domain_id}"
                )
            # Another completed claim of this domain holds the membership, and no unprepare can
            # drop it while this entry exists (both decide under the domain lock): no join, so
            # nothing in the store or on disk needs the started state recorded first.
            membership_held = self._holds_completed(config.domain_id, besides=ref.uid)

            def start(checkpoint: Checkpoint) -> ClaimEntry:
                return checkpoint.mark_prepare_started(
                    ref.uid,
                    namespace=ref.namespace,
                    name=ref.name,
                    domain_uid=config.domain_id,
                    node=node.name,
                    claim_version=claim.version,
                )

            try:
                if membership_held:
                    # Written with the completion below (or any save before it): the started
                    # state must only be visible under the lock, to unprepares of this domain.
                    self.checkpoint.apply(start)
                else:
                    await self._update_checkpoint(start)
            except StalePrepareError as exc:
                raise PermanentClaimError(str(exc)) from None
            joined_now, index = False, None
            if not membership_held:
                put = asyncio.ensure_future(self.store.put(record_key, started_record()))
                try:
                    joined_now, index = await self._join(config.domain_id, ref.namespace, node)
                finally:
                    await put
        bound = log.bind(claim_uid=ref.uid, namespace=ref.namespace, cd_uid=config.domain_id, node=node.name)
        if joined_now:
            bound.info("prepare: node joined domain")

        if fabric:
            remaining = max(deadline - self._clock(), 0.0)
            if not await self.daemons.wait_ready(config.domain_id, remaining, node_id=index):
                raise RetryableClaimError(await self._not_ready_message(config.domain_id, node.name))
            await self._ensure_channels(channels)

        cdi_id = claim_cdi_device_id(ref.uid)
        completed = pb.PreparedClaim(
            claim_uid=ref.uid,
            namespace=ref.namespace,
            name=ref.name,
            node_name=node.name,
            domain_uid=config.domain_id,
            state=pb.PreparedState.PREPARE_COMPLETED,
            cdi_device_ids=[cdi_id],
            updated_unix_ms=_now_ms(),
        )
        # The store write travels while the local files are written. Should the agent die in
        # between, the reconcile at start settles it: a completed record whose spec exists is
        # taken as completed, one without its spec as started.
        put = asyncio.ensure_future(self.batch.put(record_key, completed))
        try:
            # On the loop, as the checkpoint below: a small write and a rename, no fsync; a hop to
            # the shared thread pool waited behind every other blocking call of the process.
            self.cdi.write(ref.uid, channels=channels, major=major)
            entry = await self._update_checkpoint(
                lambda checkpoint: checkpoint.mark_prepare_completed(
                    ref.uid,
                    [cdi_id],
                    request_names=tuple(dict.fromkeys(r.request for r in results)),
                    claim_version=claim.version,
                )
            )
        except BaseException as exc:
            await self._revert_completed_record(put, record_key, started_record())
            if isinstance(exc, StalePrepareError):  # unprepared meanwhile: do not resurrect it
                self.cdi.remove(ref.uid)
                raise PermanentClaimError(str(exc)) from None
            if isinstance(exc, OSError):
                raise RetryableClaimError(
                    f"cannot write CDI spec or checkpoint for claim {ref.uid}: {exc}"
                ) from exc
            raise
        await put
        bound.info(
            "claim prepared", mode=config.allocation_mode, channels=len(channels), cdi_device_id=cdi_id
        )
        return self._devices_of(entry)

    async def _revert_completed_record(
        self, put: asyncio.Future[int], key: str, started: pb.PreparedClaim
    ) -> None:
        """The local half of a prepare failed after its completed record was sent: say started."""
        with contextlib.suppress(*STORE_FAILURES):
            await put
        with contextlib.suppress(*STORE_FAILURES):
            await self.store.put(key, started)

    def held_domain(self) -> str | None:
        """The domain of this node's completed claims, if any (claims taken over from NVIDIA's
        checkpoint do not count: they made no membership of ours)."""
        for entry in self.checkpoint.entries.values():
            if entry.state is ClaimState.PREPARE_COMPLETED and entry.migrated_from is None:
                return entry.domain_uid
        return None

    def _holds_completed(self, domain_uid: str, besides: str) -> bool:
        """Another completed claim of ours stands for the membership (a migrated one does not:
        a new claim of its domain must still join)."""
        return any(
            e.domain_uid == domain_uid
            and e.state is ClaimState.PREPARE_COMPLETED
            and e.claim_uid != besides
            and e.migrated_from is None
            for e in self.checkpoint.entries.values()
        )

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

    def _channel_config(self, claim: ResolvedClaim, requests: Sequence[str]) -> ChannelConfig:
        """The claim's one channel config; `PermanentClaimError` naming what is wrong with it."""
        decoded: ChannelConfig | None = None
        try:
            for request in requests:
                opaque = claim.config_for(DRIVER_NAME, request)
                if opaque is None:
                    raise ConfigError(f"no opaque config for request {request!r} of claim {claim.ref.name}")
                config = decode_channel_config(opaque.parameters)
                if decoded is not None and config != decoded:
                    raise ConfigError("the claim's requests name different ComputeDomain channel configs")
                decoded = config
        except ConfigError as exc:
            raise PermanentClaimError(str(exc)) from None
        assert decoded is not None
        return decoded

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
        base = f"IMEX daemon for domain {domain_uid} on node {node_name} not READY within {self.prepare_budget_s:g}s"
        try:
            status = await self.store.get(self.store.keys.daemon(domain_uid, node_name), pb.DaemonStatus)
        except STORE_FAILURES:
            return base
        if status is None:
            return base + " (no daemon status yet)"
        state = pb.DaemonState(status.value.state).name
        if status.value.reason == REASON_DRIVER_TOO_OLD:
            base = f"IMEX daemon for domain {domain_uid} cannot run on node {node_name}"
        reason = f", {status.value.reason}" if status.value.reason else ""
        detail = f"; {status.value.last_error}" if status.value.last_error else ""
        return f"{base} (daemon {state}{reason}{detail})"

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

    def _devices_of(self, entry: ClaimEntry) -> list[PreparedDevice]:
        return [
            PreparedDevice(
                request_names=entry.request_names or ("channel",),
                pool_name=entry.node,
                device_name=CHANNEL_DEVICE,
                cdi_device_ids=entry.cdi_device_ids,
            )
        ]

    def _update_checkpoint(self, mutate: Callable[[Checkpoint], T]) -> Coroutine[Any, Any, T]:
        """Change the checkpoint now (``mutate``) and return what to await for its save: it gives
        ``mutate``'s result once the change is in the file, or raises :class:`RetryableClaimError`
        with the change undone (concurrent changes share writes; see ``checkpointwriter``)."""
        return _checkpoint_written(self.checkpoint_writer.update(mutate))

    def _saved(self) -> None:
        self.metrics.prepared_claims.set(len(self.checkpoint.entries))

    # ---- unprepare -------------------------------------------------------------------------

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
        if entry is None:
            if claim_uid in self.checkpoint.tombstones:
                # Unprepared before; a retry after a failed store delete finishes it.
                await self.store.delete(self.store.keys.preparation(self.identity.node.name, claim_uid))
            else:
                # Unknown claim: success, and a tombstone in case its prepare is still on the way.
                await self._update_checkpoint(lambda checkpoint: checkpoint.remove(claim_uid))
            return
        if not entry.domain_uid:
            # Taken over from NVIDIA's checkpoint without a domain: no record, no membership.
            await self._update_checkpoint(lambda checkpoint: checkpoint.remove(claim_uid))
            log.info(
                "claim unprepared",
                claim_uid=claim_uid,
                namespace=entry.namespace,
                migrated_from=entry.migrated_from,
            )
            return
        record_key = self.store.keys.preparation(entry.node or self.identity.node.name, claim_uid)
        removed: Coroutine[Any, Any, ClaimEntry | None] | None = None
        async with self._domain_locks.hold(entry.domain_uid):
            last = not any(
                e.domain_uid == entry.domain_uid and e.claim_uid != claim_uid
                for e in self.checkpoint.entries.values()
            )
            if last:
                await self.store.delete(record_key)
                left = await leave_domain(self.store, entry.domain_uid, entry.node or self.identity.node.name)
                if left:
                    log.info("unprepare: node left domain", cd_uid=entry.domain_uid, node=entry.node)
                await self._update_checkpoint(lambda checkpoint: checkpoint.remove(claim_uid))
            else:
                # Another claim keeps the membership: decided and recorded here, under the lock
                # (a concurrent unprepare of that claim then sees this one gone and leaves); the
                # writes below need no lock, so unprepares of a domain do not queue behind each
                # other's round trips.
                removed = self._update_checkpoint(lambda checkpoint: checkpoint.remove(claim_uid))
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

    # ---- start-up reconcile ----------------------------------------------------------------

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
        for item in records:
            prep = item.value
            if prep.claim_uid in self.checkpoint.entries:
                continue
            if prep.claim_uid in self.checkpoint.tombstones:
                await self.store.delete(item.key)  # unprepared; the record outlived a crash
                report.dropped_store_records.append(prep.claim_uid)
                continue
            await self._rebuild_entry(prep, prep.claim_uid in on_disk)
            report.rebuilt_from_store.append(prep.claim_uid)
        if report.rebuilt_from_store:
            log.warning("checkpoint rebuilt from the store", node=node_name, claims=report.rebuilt_from_store)

        for entry in list(self.checkpoint.entries.values()):
            if entry.state is not ClaimState.PREPARE_STARTED:
                continue
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

        for uid in self.cdi.claim_uids():
            if uid not in self.checkpoint.entries:
                self.cdi.remove(uid)
                report.removed_cdi_specs.append(uid)

        held = {e.domain_uid for e in self.checkpoint.entries.values()}
        binding = await self.store.get(self.store.keys.node_binding(node_name), pb.NodeBinding)
        if binding is not None and binding.value.domain_uid not in held:
            await leave_domain(self.store, binding.value.domain_uid, node_name)
            report.left_domains.append(binding.value.domain_uid)
        for action in ("rebuilt_from_store", "unprepared_gone", "removed_cdi_specs", "left_domains"):
            count = len(getattr(report, action))
            if count:
                self.metrics.reconciled.labels(action=action).inc(count)
        self.metrics.prepared_claims.set(len(self.checkpoint.entries))
        log.info("reconcile done", node=node_name, **{k: v for k, v in vars(report).items() if v})
        self.reconciled.set()
        return report

    # ---- records lost from the store -------------------------------------------------------

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
        if entry is None or not entry.domain_uid or entry.migrated_from is not None:
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
            try:
                item = self.store.decode_kv(found[0], pb.PreparedClaim, strict=True) if found else None
            except UndecodableValue as exc:
                problem = f"was overwritten with an undecodable value ({exc.reason})"
            else:
                if item is None:
                    problem = "is missing (deleted)"
                elif (item.value.domain_uid, item.value.node_name) != (entry.domain_uid, node):
                    problem = f"names domain {item.value.domain_uid} on node {item.value.node_name}"
                else:
                    return None
            gone = await self._claim_gone(entry.namespace, entry.name, claim_uid)
            if not gone:
                completed = entry.state is ClaimState.PREPARE_COMPLETED
                written = await self.store.compare_and_swap(
                    key,
                    pb.PreparedClaim(
                        claim_uid=claim_uid,
                        namespace=entry.namespace,
                        name=entry.name,
                        node_name=node,
                        domain_uid=entry.domain_uid,
                        state=pb.PreparedState.PREPARE_COMPLETED
                        if completed
                        else pb.PreparedState.PREPARE_STARTED,
                        cdi_device_ids=list(entry.cdi_device_ids) if completed else [],
                        updated_unix_ms=_now_ms(),
                    ),
                    read_at,
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

    async def _rebuild_entry(self, prep: pb.PreparedClaim, has_cdi_spec: bool) -> None:
        completed: tuple[str, ...] | None = None  # the request names, when it is completed
        if prep.state == pb.PreparedState.PREPARE_COMPLETED and has_cdi_spec and prep.cdi_device_ids:
            # Finished before the checkpoint was lost, and the spec is still there: the claim's
            # own request names make the repeat answer exact.
            try:
                claim = await self.claims.resolve(ClaimRef(prep.namespace, prep.name, prep.claim_uid))
                completed = tuple(r.request for r in claim.results_for(DRIVER_NAME, prep.node_name))
            except ClaimError:
                pass  # gone or unreachable: stays PrepareStarted, handled below or by kubelet

        def rebuild(checkpoint: Checkpoint) -> None:
            checkpoint.mark_prepare_started(
                prep.claim_uid,
                namespace=prep.namespace,
                name=prep.name,
                domain_uid=prep.domain_uid,
                node=prep.node_name,
            )
            if completed is not None:
                checkpoint.mark_prepare_completed(
                    prep.claim_uid, prep.cdi_device_ids, request_names=completed
                )

        await self._update_checkpoint(rebuild)


async def _checkpoint_written(written: Awaitable[T]) -> T:
    """The result of a checkpoint update once written; a failed write is retryable for the claim."""
    try:
        return await written
    except (OSError, TimeoutError) as exc:
        raise RetryableClaimError(f"cannot write the checkpoint: {exc or 'timed out'}") from exc


def _check_domain(ref: ClaimRef, config: ChannelConfig, domain: DomainHeader | None) -> None:
    """The claim may use the domain: it exists, is in the claim's namespace, is not going away."""
    if domain is None:
        raise PermanentClaimError(
            f"ComputeDomain {config.domain_id} named by claim {ref.namespace}/{ref.name} does not exist"
        )
    if domain.namespace != ref.namespace:
        # Do not tell which namespace it is in: that is the other tenant's business.
        raise PermanentClaimError(
            f"ComputeDomain {config.domain_id} is not in namespace {ref.namespace} of claim "
            f"{ref.namespace}/{ref.name}; a claim may only use a ComputeDomain of its own namespace"
        )
    if domain.deleting:
        raise PermanentClaimError(f"ComputeDomain {domain.namespace}/{domain.name} is being deleted")
