"""What the start-up reconcile must do (pure); ``shell/state.py`` applies it, in this order:

    plan_records(records, checkpoint, on_disk)     store records vs checkpoint: drop or rebuild
    half_prepared(entries)                          started claims to check with their source
    stale_specs(spec_uids, entries)                 CDI specs of claims not held
    domain_to_leave(bound_domain, entries)          a membership without a held claim

and what the record keeper writes back for a held claim whose PreparedClaim the store lost
(``record_problem``, ``restored_record``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TypeGuard

from libs.gen.computedomain.state import v1 as pb
from services.nodeagent.core.checkpoint import Checkpoint, ClaimEntry, ClaimState, Tombstone


@dataclass(frozen=True)
class DropRecord:
    """A record of a claim unprepared here (tombstoned): it outlived a crash."""

    key: str
    claim_uid: str


@dataclass(frozen=True)
class RebuildEntry:
    """A record the checkpoint lacks (it was corrupt, or lost): its entry is taken back."""

    record: pb.PreparedClaim
    has_cdi_spec: bool

    @property
    def wants_request_names(self) -> bool:
        """Finished before the checkpoint was lost, and its spec is still there: it is taken back
        as completed, with the claim's own request names (asked of its source) so that a repeated
        prepare answers exactly; otherwise it is taken back as started."""
        prep = self.record
        return (
            prep.state == pb.PreparedState.PREPARE_COMPLETED
            and self.has_cdi_spec
            and bool(prep.cdi_device_ids)
        )

    def rebuild(self, checkpoint: Checkpoint, request_names: tuple[str, ...] | None) -> None:
        """The checkpoint change (a ``mutate``): started, and completed when ``request_names``
        are known (see :attr:`wants_request_names`)."""
        prep = self.record
        checkpoint.mark_prepare_started(
            prep.claim_uid,
            namespace=prep.namespace,
            name=prep.name,
            domain_uid=prep.domain_uid,
            node=prep.node_name,
        )
        if request_names is not None:
            checkpoint.mark_prepare_completed(
                prep.claim_uid, prep.cdi_device_ids, request_names=request_names
            )


def plan_records(
    records: Iterable[tuple[str, pb.PreparedClaim]],
    entries: Mapping[str, ClaimEntry],
    tombstones: Mapping[str, Tombstone],
    on_disk: set[str],
) -> list[DropRecord | RebuildEntry]:
    """This node's store records (key, record) against its checkpoint, in record order; records of
    claims the checkpoint holds need nothing. ``on_disk``: the claims with a CDI spec."""
    steps: list[DropRecord | RebuildEntry] = []
    held = set(entries)
    for key, prep in records:
        if prep.claim_uid in held:
            continue
        if prep.claim_uid in tombstones:
            steps.append(DropRecord(key, prep.claim_uid))
        else:
            steps.append(RebuildEntry(prep, prep.claim_uid in on_disk))
            held.add(prep.claim_uid)  # a second record naming the claim finds it held
    return steps


def half_prepared(entries: Iterable[ClaimEntry]) -> list[ClaimEntry]:
    """Claims whose prepare started and did not complete: unprepared if their claim is gone."""
    return [e for e in entries if e.state is ClaimState.PREPARE_STARTED]


def stale_specs(spec_uids: Iterable[str], entries: Mapping[str, ClaimEntry]) -> list[str]:
    """CDI specs of claims this node does not hold."""
    return [uid for uid in spec_uids if uid not in entries]


def domain_to_leave(bound_domain: str | None, entries: Iterable[ClaimEntry]) -> str | None:
    """The domain this node is bound to (its NodeBinding) when no held claim is of it."""
    if bound_domain is None or bound_domain in {e.domain_uid for e in entries}:
        return None
    return bound_domain


def needs_record(entry: ClaimEntry | None) -> TypeGuard[ClaimEntry]:
    """A held claim that stands for a PreparedClaim record of ours (not one taken over from
    NVIDIA's checkpoint, which made none)."""
    return entry is not None and bool(entry.domain_uid) and entry.migrated_from is None


def record_problem(entry: ClaimEntry, node: str, found: pb.PreparedClaim | None) -> str | None:
    """What is wrong with the record read back for a held claim (None: nothing). An undecodable
    value is the caller's to name."""
    if found is None:
        return "is missing (deleted)"
    if (found.domain_uid, found.node_name) != (entry.domain_uid, node):
        return f"names domain {found.domain_uid} on node {found.node_name}"
    return None


def restored_record(entry: ClaimEntry, node: str, now_ms: int) -> pb.PreparedClaim:
    """The record a held claim stands for, as its checkpoint entry says."""
    completed = entry.state is ClaimState.PREPARE_COMPLETED
    return pb.PreparedClaim(
        claim_uid=entry.claim_uid,
        namespace=entry.namespace,
        name=entry.name,
        node_name=node,
        domain_uid=entry.domain_uid,
        state=pb.PreparedState.PREPARE_COMPLETED if completed else pb.PreparedState.PREPARE_STARTED,
        cdi_device_ids=list(entry.cdi_device_ids) if completed else [],
        updated_unix_ms=now_ms,
    )
