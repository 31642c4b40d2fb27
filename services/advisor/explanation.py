"""Explain: the decision a request gets and the alternatives the policies would have chosen
(pure: over the same view the decision was taken on)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from services.advisor import policies
from services.advisor.model import Decision, PlacementRequest, PolicyName, Segment
from services.advisor.policies import Demand, PlacementPlan
from services.advisor.views import View


@dataclass(frozen=True, slots=True)
class Alternative:
    segments: tuple[Segment, ...]
    score: float
    description: str
    chosen: bool


@dataclass(frozen=True, slots=True)
class Explanation:
    decision: Decision
    alternatives: tuple[Alternative, ...]


def explain(req: PlacementRequest, decision: Decision, view: View, limit: int) -> Explanation:
    """The decision taken and up to `limit` alternatives (what each policy would choose, the
    best single cliques), scored alike, the chosen one first."""
    demand = Demand(req.num_nodes, req.mode, req.segment_size)
    free_of = {c.clique_id: c.free for c in view.index.entries.values()}
    min_cliques = policies.min_cliques_needed(view.index.histogram(), demand)
    chosen_key = tuple((s.clique_id, len(s.node_names)) for s in decision.segments)
    found: dict[tuple[tuple[str, int], ...], Alternative] = {}

    def add(outcome: PlacementPlan, description: str) -> None:
        if outcome.parts in found:
            return
        segments = policies.pick_nodes(outcome, {c: view.names(c) for c in outcome.cliques})
        found[outcome.parts] = Alternative(
            segments=segments,
            score=policies.score(outcome, free_of, min_cliques),
            description=description,
            chosen=outcome.parts == chosen_key,
        )

    if decision.feasible:
        add(PlacementPlan(chosen_key), f"chosen by {req.policy.value}")
    for policy in PolicyName:
        outcome = policies.plan(
            demand, view.index, policy, largest_clique=view.largest, rng=random.Random(req.seed or 1)
        )
        if isinstance(outcome, PlacementPlan):
            add(outcome, f"what {policy.value} would choose")
    for outcome, _ in policies.single_clique_candidates(demand, view.index, limit):
        add(outcome, f"single clique {outcome.parts[0][0]}")
    ranked = sorted(found.values(), key=lambda a: (not a.chosen, -a.score))
    return Explanation(decision, tuple(ranked[: max(limit, 1)]))
