"""Membership decisions of the controller (pure): node loss and return, lost members, orphans.

- An active member is marked LOST when its node record is gone (its IMEX
  side's lease expired) and no live peer's daemon reports it connected
  (`liveness.py`). Nothing else changes: it keeps its index and claim, its
  slot in the peers' nodes config, and its binding.
- A LOST member whose node record is back while the node still holds claims
  of the domain is made ACTIVE again, at the same index, with the address of
  its node record. So is an active member whose record shows a new address.
- A LOST member with no prepared claim of the domain left on its node is
  released (member, binding and index claim removed): either the node came
  back without work for this domain, or its work was cleaned up. That is the
  only way a lost member's index is freed. Until then the binding keeps the
  node out of other domains, and the domain shows NodeLost. A node lost for
  good never unprepares: in Kubernetes mode the adapter checks the claims of
  `lost_holdings` against the API server and drops the records of claims that
  are gone there (`kube/lost_claims.py`), which releases the member.
- Records of a domain that no longer exists (a join that raced the
  teardown) are released after a grace period, long enough for the
  Kubernetes adapter to mirror a freshly created CR.
"""

from __future__ import annotations

from services.controller.actions import (
    Action,
    ActivateMember,
    DeleteDaemonStatus,
    MarkMemberLost,
    ReleaseMember,
)
from services.controller.liveness import Liveness, live_peers, liveness
from services.controller.observed import DomainObservation


def loss_actions(obs: DomainObservation, live: Liveness | None = None) -> list[Action]:
    """MarkMemberLost for every active member with no node record that no live peer vouches for."""
    gone = (live if live is not None else liveness(obs)).gone
    out: list[Action] = []
    for name, member in sorted(obs.members.items()):
        if member.lost or name not in gone:
            continue
        reports = tuple(
            (peer, daemon.mod_revision if (daemon := obs.daemons.get(peer)) is not None else 0)
            for peer in live_peers(obs, name)
        )
        out.append(MarkMemberLost(name, reports))
    return out


def activations(obs: DomainObservation) -> list[Action]:
    """ActivateMember for returned LOST members still holding claims, and for moved addresses."""
    out: list[Action] = []
    for name, member in sorted(obs.members.items()):
        node = obs.nodes.get(name)
        if node is None:
            continue
        if member.fabric and member.index < 0:
            continue  # a LOST member from before indices were kept: its agent's join gives it one
        if member.lost:
            claims = obs.preparations.get(name)
            if claims:
                out.append(ActivateMember(name, member.mod_revision, "node back", tuple(sorted(claims))))
        elif node.ip_address and node.ip_address != member.ip_address:
            out.append(ActivateMember(name, member.mod_revision, "node address changed"))
    return out


def lost_member_releases(obs: DomainObservation) -> list[Action]:
    """ReleaseMember for every LOST member without a prepared claim of this domain on its node."""
    out: list[Action] = []
    for name, member in sorted(obs.members.items()):
        if member.lost and not obs.preparations.get(name):
            why = "node back without claims of this domain" if obs.node_present(name) else "no claims left"
            out.append(ReleaseMember(name, member.clique_id, member.index, member.mod_revision, why))
    return out


def lost_holdings(obs: DomainObservation, live: Liveness | None = None) -> list[tuple[str, str]]:
    """(node, claim uid) of the prepared claims held by LOST members that are gone now.

    Only these may be checked against the claim source and dropped by the controller: a live
    node's plugin owns its records, and a LOST member whose node is back (or that a live peer
    reaches) may still run its pods, which will unprepare.
    """
    gone = (live if live is not None else liveness(obs)).gone
    return [
        (name, claim)
        for name, member in sorted(obs.members.items())
        if member.lost and name in gone
        for claim in sorted(obs.preparations.get(name, ()))
    ]


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
