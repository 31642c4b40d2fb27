"""What a claim's prepare must do on this node (pure); ``shell/state.py`` applies it.

Decided from what the shell observed, in the order the shell observes it::

    admit_claim(ref, claim, node_name, tombstoned)   the claim: ours, one valid channel config
    plan_prepare(request, domain, node)              the domain and this node: a PreparePlan
    plan_start(plan, existing, membership_held)      under the domain lock: join or ride along

Each raises :class:`PermanentClaimError` or :class:`RetryableClaimError` naming what is wrong,
before anything is written. The plan also builds what the shell writes: the checkpoint changes
(``start``, ``complete``) and the PreparedClaim records (``started_record``,
``completed_record``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

from libs.cdi.spec import channels_for, claim_cdi_device_id
from libs.contract.channel_config import ChannelConfig, ConfigError, decode_channel_config
from libs.contract.names import CHANNEL_DEVICE, DRIVER_NAME, REASON_DRIVER_TOO_OLD
from libs.gen.computedomain.state import v1 as pb
from services.nodeagent.core.checkpoint import Checkpoint, ClaimEntry, ClaimState
from services.nodeagent.core.claim import ClaimRef, ResolvedClaim
from services.nodeagent.core.domain_header import DomainHeader
from services.nodeagent.core.errors import PermanentClaimError, RetryableClaimError


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """One entry of a NodePrepareResources answer, independent of the API version."""

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]


@dataclass(frozen=True)
class ChannelRequest:
    """A claim this node may prepare as far as the claim itself goes (its domain unchecked)."""

    ref: ClaimRef
    version: str
    config: ChannelConfig
    # The requests that were allocated our device here, once each, in allocation order.
    request_names: tuple[str, ...]


@dataclass(frozen=True)
class PreparePlan:
    """What preparing one claim on this node takes."""

    request: ChannelRequest
    node_name: str
    # On an NVLink fabric: wait for this node's IMEX daemon and create the channel devices.
    fabric: bool
    channels: Sequence[int]
    cdi_device_id: str

    @property
    def domain_uid(self) -> str:
        return self.request.config.domain_id

    def start(self, checkpoint: Checkpoint) -> ClaimEntry:
        """The checkpoint change that records the prepare as started (a ``mutate``)."""
        ref = self.request.ref
        return checkpoint.mark_prepare_started(
            ref.uid,
            namespace=ref.namespace,
            name=ref.name,
            domain_uid=self.domain_uid,
            node=self.node_name,
            claim_version=self.request.version,
        )

    def complete(self, checkpoint: Checkpoint) -> ClaimEntry:
        """The checkpoint change that records the prepare as completed (a ``mutate``)."""
        return checkpoint.mark_prepare_completed(
            self.request.ref.uid,
            [self.cdi_device_id],
            request_names=self.request.request_names,
            claim_version=self.request.version,
        )

    def started_record(self, now_ms: int) -> pb.PreparedClaim:
        return self._record(pb.PreparedState.PREPARE_STARTED, [], now_ms)

    def completed_record(self, now_ms: int) -> pb.PreparedClaim:
        return self._record(pb.PreparedState.PREPARE_COMPLETED, [self.cdi_device_id], now_ms)

    def _record(self, state: pb.PreparedState, cdi_device_ids: list[str], now_ms: int) -> pb.PreparedClaim:
        ref = self.request.ref
        return pb.PreparedClaim(
            claim_uid=ref.uid,
            namespace=ref.namespace,
            name=ref.name,
            node_name=self.node_name,
            domain_uid=self.domain_uid,
            state=state,
            cdi_device_ids=cdi_device_ids,
            updated_unix_ms=now_ms,
        )


class StartStep(Enum):
    """How a prepare starts, decided under the domain lock."""

    # Record the started state (checkpoint saved, PreparedClaim PREPARE_STARTED), then join.
    JOIN = "join"
    # Another completed claim of this domain holds the membership, and no unprepare can drop it
    # while this entry exists (both decide under the domain lock): no join, so nothing in the
    # store or on disk needs the started state first. The started entry is applied in memory
    # and saved with the completion: it must only be visible, under the lock, to unprepares of
    # this domain.
    RIDE_ALONG = "ride-along"


def admit_claim(ref: ClaimRef, claim: ResolvedClaim, node_name: str, tombstoned: bool) -> ChannelRequest:
    """The claim's channel request, or why this node refuses it. ``tombstoned``: the checkpoint
    refuses a prepare of this claim at ``claim.version`` (unprepared moments ago)."""
    results = claim.results_for(DRIVER_NAME, node_name)
    if not results:
        raise PermanentClaimError(
            f"claim {ref.namespace}/{ref.name} has no device of driver {DRIVER_NAME} allocated on node {node_name}"
        )
    for result in results:
        if result.device != CHANNEL_DEVICE:
            raise PermanentClaimError(
                f"claim {ref.namespace}/{ref.name} was allocated unknown device {result.device!r} "
                f"of driver {DRIVER_NAME} (this node offers {CHANNEL_DEVICE})"
            )
    requests = [r.request for r in results]
    config = channel_config(claim, requests)
    if tombstoned:
        raise PermanentClaimError(
            f"claim {ref.namespace}/{ref.name} ({ref.uid}) was unprepared recently; refusing a stale prepare"
        )
    return ChannelRequest(ref, claim.version, config, tuple(dict.fromkeys(requests)))


def channel_config(claim: ResolvedClaim, requests: Sequence[str]) -> ChannelConfig:
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


def plan_prepare(request: ChannelRequest, domain: DomainHeader | None, node: pb.Node) -> PreparePlan:
    """The prepare of an admitted claim whose domain record is ``domain`` (None: absent)."""
    check_domain(request.ref, request.config, domain)  # the security boundary: nothing written yet
    fabric = bool(node.clique_id)
    if not fabric and node.fabric_message:
        raise RetryableClaimError(f"node {node.name}: NVLink clique not known yet: {node.fabric_message}")
    return PreparePlan(
        request=request,
        node_name=node.name,
        fabric=fabric,
        channels=channels_for(request.config.allocation_mode, fabric=fabric),
        cdi_device_id=claim_cdi_device_id(request.ref.uid),
    )


def check_domain(ref: ClaimRef, config: ChannelConfig, domain: DomainHeader | None) -> None:
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


def plan_start(plan: PreparePlan, existing: ClaimEntry | None, membership_held: bool) -> StartStep:
    """How the prepare starts, given the claim's checkpoint entry and whether another completed
    claim of the domain holds the membership (:func:`membership_held`), both read under the lock."""
    # A claim taken over from NVIDIA's checkpoint without a known domain takes the claim's.
    if existing is not None and existing.domain_uid and existing.domain_uid != plan.domain_uid:
        raise PermanentClaimError(
            f"claim {plan.request.ref.uid} was started for domain {existing.domain_uid}, now names {plan.domain_uid}"
        )
    return StartStep.RIDE_ALONG if membership_held else StartStep.JOIN


def membership_held(entries: Iterable[ClaimEntry], domain_uid: str, besides: str) -> bool:
    """Another completed claim of ours stands for the membership (a migrated one does not: a new
    claim of its domain must still join)."""
    return any(
        e.domain_uid == domain_uid
        and e.state is ClaimState.PREPARE_COMPLETED
        and e.claim_uid != besides
        and e.migrated_from is None
        for e in entries
    )


def held_domain(entries: Iterable[ClaimEntry]) -> str | None:
    """The domain of this node's completed claims, if any (claims taken over from NVIDIA's
    checkpoint do not count: they made no membership of ours)."""
    for entry in entries:
        if entry.state is ClaimState.PREPARE_COMPLETED and entry.migrated_from is None:
            return entry.domain_uid
    return None


def finished_answer(entry: ClaimEntry | None) -> list[PreparedDevice] | None:
    """The answer to a repeat of a finished prepare (it has no side effects); None when the
    claim's prepare has not completed."""
    if entry is None or entry.state is not ClaimState.PREPARE_COMPLETED:
        return None
    return devices_of(entry)


def devices_of(entry: ClaimEntry) -> list[PreparedDevice]:
    """What kubelet is told about a prepared claim (also on a repeat of a finished prepare)."""
    return [
        PreparedDevice(
            request_names=entry.request_names or ("channel",),
            pool_name=entry.node,
            device_name=CHANNEL_DEVICE,
            cdi_device_ids=entry.cdi_device_ids,
        )
    ]


def not_ready_message(
    domain_uid: str, node_name: str, budget_s: float, status: pb.DaemonStatus | None, *, read: bool = True
) -> str:
    """Why a prepare gave up waiting for this node's IMEX daemon, from its status (``read``
    False: the store could not be asked)."""
    base = f"IMEX daemon for domain {domain_uid} on node {node_name} not READY within {budget_s:g}s"
    if not read:
        return base
    if status is None:
        return base + " (no daemon status yet)"
    state = pb.DaemonState(status.state).name
    if status.reason == REASON_DRIVER_TOO_OLD:
        base = f"IMEX daemon for domain {domain_uid} cannot run on node {node_name}"
    reason = f", {status.reason}" if status.reason else ""
    detail = f"; {status.last_error}" if status.last_error else ""
    return f"{base} (daemon {state}{reason}{detail})"
