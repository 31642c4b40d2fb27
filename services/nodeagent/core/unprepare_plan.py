"""What a claim's unprepare must do on this node (pure); ``shell/state.py`` applies it.

    plan_unprepare(entry, has_tombstone)   which kind of unprepare, from the checkpoint
    leaves_domain(entries, entry)           under the domain lock: is this the last claim?
    forget(claim_uid)                       the checkpoint change: entry out, tombstone in

Unprepare is idempotent: an unknown claim succeeds (and is tombstoned, in case its prepare is
still on the way), a repeat finishes what a failed attempt left.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from enum import Enum

from services.nodeagent.core.checkpoint import Checkpoint, ClaimEntry


class UnprepareStep(Enum):
    # Unprepared before (tombstoned, no entry): delete the store record a failed attempt left.
    DELETE_RECORD = "delete-record"
    # Unknown claim: a tombstone, so that a prepare still on the way is refused.
    TOMBSTONE = "tombstone"
    # Taken over from NVIDIA's checkpoint without a domain: no record, no membership; drop it.
    FORGET_MIGRATED = "forget-migrated"
    # A claim of a domain: under the domain lock, the last claim leaves (see `leaves_domain`).
    RELEASE = "release"


def plan_unprepare(entry: ClaimEntry | None, has_tombstone: bool) -> UnprepareStep:
    """``entry``: the claim's checkpoint entry; ``has_tombstone``: the checkpoint holds a
    tombstone of the claim (expired or not)."""
    if entry is None:
        return UnprepareStep.DELETE_RECORD if has_tombstone else UnprepareStep.TOMBSTONE
    if not entry.domain_uid:
        return UnprepareStep.FORGET_MIGRATED
    return UnprepareStep.RELEASE


def leaves_domain(entries: Iterable[ClaimEntry], entry: ClaimEntry) -> bool:
    """No other claim of ``entry``'s domain is held on this node, started or completed: the
    unprepare of ``entry`` deletes its record, leaves the domain and drops the entry, all under
    the domain lock. Otherwise the other claim keeps the membership: the entry is dropped under
    the lock (a concurrent unprepare of that claim then sees this one gone and leaves) and the
    record deleted outside it."""
    return not any(e.domain_uid == entry.domain_uid and e.claim_uid != entry.claim_uid for e in entries)


def forget(claim_uid: str) -> Callable[[Checkpoint], ClaimEntry | None]:
    """The checkpoint change of an unprepare (a ``mutate``): the entry goes, a tombstone stays."""
    return lambda checkpoint: checkpoint.remove(claim_uid)
