"""Teardown of a deleted domain (pure): the steps, one observation at a time.

Deletion sets `deleting` on the domain record. Members leave as their node
agents unprepare the claims (the controller never evicts an active member:
a CD deleted while pods still run stays terminating until they release).
Nodes that are gone cannot unprepare, so their prepared-claim records are
dropped here; their LOST members are then released (`membership_decisions.py`). Gone is
`liveness.py`'s answer on the current reports, the one the loss decision
uses, not the LOST mark: a node a live peer reaches may still run the job. Once
no member and no prepared claim is left, one transaction removes the domain
record with every per-domain prefix (index claims, daemon statuses).
"""

from __future__ import annotations

from services.controller.actions import Action, DeleteDomain, DeletePreparation
from services.controller.liveness import Liveness, liveness
from services.controller.observed import DomainObservation


def stale_preparations(obs: DomainObservation, live: Liveness | None = None) -> list[Action]:
    """Prepared claims of this domain on nodes that are gone.

    Gone: the node record is absent and, for a member, no live peer reports it connected (a
    node whose IMEX side only restarts still runs its pods, which will unprepare). None in a
    clique where a LOST member's record is back: this same plan makes it ACTIVE again, and then
    its report counts; deciding before that could drop claims of a node it still reaches.
    """
    live = live if live is not None else liveness(obs)
    returning_cliques = {obs.members[n].clique_id for n in live.returning}
    out: list[Action] = []
    for node in sorted(obs.preparations):
        if obs.node_present(node):
            continue
        member = obs.members.get(node)
        if member is not None and (node not in live.gone or member.clique_id in returning_cliques):
            continue
        out.extend(DeletePreparation(node, claim) for claim in sorted(obs.preparations[node]))
    return out


def teardown_actions(obs: DomainObservation, live: Liveness | None = None) -> list[Action]:
    if obs.domain is None or not obs.domain.deleting:
        return []
    out = stale_preparations(obs, live)
    if not obs.members and not any(obs.preparations.values()):
        out.append(DeleteDomain(obs.domain_revision))
    return out
