"""Teardown of a deleted domain (pure): the steps, one observation at a time.

Deletion sets `deleting` on the domain record. Members leave as their node
agents unprepare the claims (the controller never evicts an active member:
a CD deleted while pods still run stays terminating until they release).
Nodes that are gone (lost) cannot unprepare, so their prepared-claim records
are dropped here; their LOST members are then released (`membership.py`). Once
no member and no prepared claim is left, one transaction removes the domain
record with every per-domain prefix (index claims, daemon statuses).
"""

from __future__ import annotations

from services.controller.actions import Action, DeleteDomain, DeletePreparation
from services.controller.liveness import liveness
from services.controller.observed import DomainObservation


def stale_preparations(obs: DomainObservation) -> list[Action]:
    """Prepared claims of this domain on nodes that are gone.

    Gone: the node record is absent and, for a member, no peer reports it connected (a
    node whose IMEX side only restarts still runs its pods, which will unprepare).
    """
    lost = liveness(obs).lost
    out: list[Action] = []
    for node in sorted(obs.preparations):
        if not obs.node_present(node) and (node not in obs.members or node in lost):
            out.extend(DeletePreparation(node, claim) for claim in sorted(obs.preparations[node]))
    return out


def teardown_actions(obs: DomainObservation) -> list[Action]:
    if obs.domain is None or not obs.domain.deleting:
        return []
    out = stale_preparations(obs)
    if not obs.members and not any(obs.preparations.values()):
        out.append(DeleteDomain(obs.domain_revision))
    return out
