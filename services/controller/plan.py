"""One reconcile decision for one domain (pure): the status to show and the actions to take."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.controller import cd_status, membership_decisions, teardown
from services.controller.actions import Action, DeleteDomain
from services.controller.liveness import liveness
from services.controller.mesh_plan import mesh_actions
from services.controller.observed import DomainObservation
from services.controller.status_model import StatusValue


@dataclass(frozen=True)
class DomainPlan:
    # The status to write, or None when the stored one is already right (or there is no domain).
    status: StatusValue | None
    actions: list[Action] = field(default_factory=list)
    # Look again after this long: a record is waiting out its grace period.
    recheck_after_ms: int | None = None


def plan_domain(
    obs: DomainObservation, now_ms: int, orphan_grace_ms: int, mesh_tls: bool = True
) -> DomainPlan:
    """`mesh_tls`: the mode a domain gets when it is first seen (mutual TLS, or plaintext)."""
    recheck = membership_decisions.grace_recheck_ms(obs, now_ms, orphan_grace_ms)
    mesh = mesh_actions(obs, mesh_tls, now_ms, orphan_grace_ms)
    if obs.domain is None:
        return DomainPlan(
            None, membership_decisions.orphan_actions(obs, now_ms, orphan_grace_ms) + mesh, recheck
        )
    # Who is lost and whose mesh is complete: one pass over the members and their reports.
    live = liveness(obs)
    actions: list[Action] = membership_decisions.loss_actions(obs, live)
    actions += membership_decisions.activations(obs)
    actions += membership_decisions.lost_member_releases(obs)
    actions += mesh
    actions += teardown.teardown_actions(obs, live)
    if not obs.domain.deleting:
        actions += membership_decisions.stale_daemon_statuses(obs, now_ms, orphan_grace_ms)
    if any(isinstance(a, DeleteDomain) for a in actions):
        return DomainPlan(None, actions)
    desired = cd_status.desired_status(obs, obs.status, now_ms, live)
    return DomainPlan(desired if desired != obs.status else None, actions, recheck)
