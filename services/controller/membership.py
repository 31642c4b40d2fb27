"""Membership decisions of the controller (pure): node loss, lost members, orphans.

- An active member whose node record is gone (the agent's lease expired) is
  marked LOST: its index is freed and peers drop it from their nodes config.
- A LOST member with no prepared claim of the domain left on its node is
  released (member and binding removed): either the node came back without
  work for this domain, or its work was cleaned up. Until then the binding
  keeps the node out of other domains, and the domain shows NodeLost.
- Records of a domain that no longer exists (a join that raced the
  teardown) are released after a grace period, long enough for the
  Kubernetes adapter to mirror a freshly created CR.
"""

from __future__ import annotations

from services.controller.actions import Action, DeleteDaemonStatus, MarkMemberLost, ReleaseMember
from services.controller.observed import DomainObservation


def loss_actions(obs: DomainObservation) -> list[Action]:
    """MarkMemberLost for every active member whose node record is absent."""
    return [
        MarkMemberLost(name)
        for name, member in sorted(obs.members.items())
        if not member.lost and not obs.node_present(name)
    ]


def lost_member_releases(obs: DomainObservation) -> list[Action]:
    """ReleaseMember for every LOST member without a prepared claim of this domain on its node."""
    out: list[Action] = []
    for name, member in sorted(obs.members.items()):
        if member.lost and not obs.preparations.get(name):
            why = "node back without claims of this domain" if obs.node_present(name) else "no claims left"
            out.append(ReleaseMember(name, member.clique_id, member.index, member.mod_revision, why))
    return out


def stale_daemon_statuses(obs: DomainObservation, now_ms: int, grace_ms: int) -> list[Action]:
    """Daemon statuses of nodes that are not members, older than the grace period."""
    return [
        DeleteDaemonStatus(name)
        for name, daemon in sorted(obs.daemons.items())
        if name not in obs.members and now_ms - daemon.updated_unix_ms >= grace_ms
    ]


def orphan_actions(obs: DomainObservation, now_ms: int, grace_ms: int) -> list[Action]:
    """Release what is left of a domain whose record is absent."""
    if obs.domain is not None:
        return []
    out: list[Action] = [
        ReleaseMember(name, m.clique_id, m.index, m.mod_revision, "domain does not exist", orphan=True)
        for name, m in sorted(obs.members.items())
        if now_ms - m.joined_unix_ms >= grace_ms
    ]
    out.extend(stale_daemon_statuses(obs, now_ms, grace_ms))
    return out


def grace_recheck_ms(obs: DomainObservation, now_ms: int, grace_ms: int) -> int | None:
    """Milliseconds until a record now inside its grace period leaves it (None: nothing waits)."""
    pending: list[int] = []
    if obs.domain is None:
        pending += [m.joined_unix_ms + grace_ms - now_ms for m in obs.members.values()]
    if obs.domain is None or not obs.domain.deleting:
        pending += [
            d.updated_unix_ms + grace_ms - now_ms for n, d in obs.daemons.items() if n not in obs.members
        ]
    waiting = [p for p in pending if p > 0]
    return min(waiting) if waiting else None
