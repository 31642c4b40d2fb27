"""Placement policies as pure functions: hypothesis properties and worked examples."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from services.advisor import policies
from services.advisor.clique_index import CliqueFree, CliqueIndex
from services.advisor.model import Mode, PolicyName, Reason
from services.advisor.policies import Demand, Infeasible, PlacementPlan


@st.composite
def cliques_st(draw: st.DrawFn) -> list[CliqueFree]:
    count = draw(st.integers(min_value=1, max_value=25))
    out = []
    for i in range(count):
        size = draw(st.sampled_from([1, 2, 4, 8, 9, 18, 18, 18, 36, 72]))
        free = draw(st.integers(min_value=0, max_value=size))
        out.append(CliqueFree(f"c{i:02d}", free, size, (i,)))
    return out


@st.composite
def demand_st(draw: st.DrawFn) -> Demand:
    mode = draw(st.sampled_from(list(Mode)))
    n = draw(st.integers(min_value=1, max_value=120))
    segment = 0
    if mode is Mode.ALLOW_SPLIT and draw(st.booleans()):
        segment = draw(st.sampled_from([1, 2, 4, 9, 18]))
        n = segment * draw(st.integers(min_value=1, max_value=8))
    return Demand(n, mode, segment)


def _taken(plan: PlacementPlan) -> Counter[str]:
    taken: Counter[str] = Counter()
    for clique, count in plan.parts:
        taken[clique] += count
    return taken


@settings(max_examples=150, deadline=None)
@given(cliques_st(), demand_st(), st.sampled_from(list(PolicyName)), st.integers(0, 2**16))
def test_plan_respects_capacity_mode_and_reasons(cliques, demand, policy, seed) -> None:
    index = CliqueIndex.from_cliques(cliques)
    largest = max(c.size for c in cliques)
    outcome = policies.plan(demand, index, policy, largest_clique=largest, rng=random.Random(seed))
    free = {c.clique_id: c.free for c in cliques}
    total = sum(free.values())
    n = demand.num_nodes

    if isinstance(outcome, Infeasible):
        if total < n:
            assert outcome.reason is Reason.NO_CAPACITY
        elif demand.mode is Mode.REQUIRE_SINGLE_CLIQUE:
            expected = Reason.NO_SINGLE_CLIQUE_FIT if largest < n else Reason.FRAGMENTED
            assert outcome.reason is expected
            assert max(free.values()) < n
        elif demand.mode is Mode.ALLOW_SPLIT:
            unit = demand.unit
            if unit > largest:
                assert outcome.reason is Reason.NO_SINGLE_CLIQUE_FIT
            else:
                assert outcome.reason is Reason.FRAGMENTED
                assert sum(f // unit for f in free.values()) < n // unit
        else:
            raise AssertionError(f"PREFER_SINGLE_CLIQUE with {total} free >= {n} must be feasible")
        return

    # Feasible: exactly n nodes, never more from a clique than it has free.
    assert outcome.num_nodes == n
    for clique, count in _taken(outcome).items():
        assert count <= free[clique], (clique, count, free[clique])
    if demand.mode is Mode.REQUIRE_SINGLE_CLIQUE:
        assert len(outcome.cliques) == 1
    if demand.mode is Mode.ALLOW_SPLIT and demand.segment_size:
        assert all(count == demand.segment_size for _, count in outcome.parts)
    if (
        demand.mode is Mode.PREFER_SINGLE_CLIQUE
        and max(free.values()) >= n
        and policy is not PolicyName.SPREAD
    ):
        assert len(outcome.cliques) == 1
    if policy is PolicyName.BEST_FIT and demand.mode is not Mode.REQUIRE_SINGLE_CLIQUE:
        # Largest blocks first, best fit for the rest: never more cliques than necessary.
        assert len(outcome.cliques) == policies.min_cliques_needed(Counter(free.values()).items(), demand)


@settings(max_examples=100, deadline=None)
@given(cliques_st(), st.integers(1, 72))
def test_single_clique_choice_of_each_policy(cliques, n) -> None:
    index = CliqueIndex.from_cliques(cliques)
    largest = max(c.size for c in cliques)
    fits = [c for c in cliques if c.free >= n]
    demand = Demand(n, Mode.REQUIRE_SINGLE_CLIQUE)
    by_id = {c.clique_id: c for c in cliques}
    for policy in PolicyName:
        outcome = policies.plan(demand, index, policy, largest_clique=largest, rng=random.Random(1))
        if not fits:
            assert isinstance(outcome, Infeasible)
            continue
        assert isinstance(outcome, PlacementPlan)
        chosen = by_id[outcome.parts[0][0]]
        assert chosen.free >= n
        if policy is PolicyName.BEST_FIT:
            # The smallest block that fits; among equals the fuller clique, then inventory order.
            assert chosen == min(fits, key=lambda c: (c.free, -c.size, c.rank))
        elif policy is PolicyName.FIRST_FIT:
            assert chosen == min(fits, key=lambda c: c.rank)
        elif policy is PolicyName.SPREAD:
            assert chosen == min(fits, key=lambda c: (-c.free, c.rank))


@settings(max_examples=80, deadline=None)
@given(cliques_st(), st.integers(1, 18))
def test_best_fit_scores_at_least_as_high_as_any_baseline(cliques, n) -> None:
    index = CliqueIndex.from_cliques(cliques)
    largest = max(c.size for c in cliques)
    free = {c.clique_id: c.free for c in cliques}
    demand = Demand(n, Mode.PREFER_SINGLE_CLIQUE)
    need = policies.min_cliques_needed(Counter(free.values()).items(), demand)
    scores = {}
    for policy in PolicyName:
        outcome = policies.plan(demand, index, policy, largest_clique=largest, rng=random.Random(7))
        if isinstance(outcome, PlacementPlan):
            scores[policy] = policies.score(outcome, free, need)
            assert 0.0 <= scores[policy] <= 100.0
    if scores and max(free.values()) >= n:
        assert scores[PolicyName.BEST_FIT] == max(scores.values())


def test_best_fit_keeps_the_whole_rack_whole() -> None:
    cliques = [
        CliqueFree("whole", 18, 18, (0,)),
        CliqueFree("half", 9, 18, (1,)),
        CliqueFree("five", 5, 18, (2,)),
    ]
    index = CliqueIndex.from_cliques(cliques)
    pick = policies.plan(Demand(4, Mode.REQUIRE_SINGLE_CLIQUE), index, PolicyName.BEST_FIT, largest_clique=18)
    assert pick == PlacementPlan((("five", 4),))
    first = policies.plan(
        Demand(4, Mode.REQUIRE_SINGLE_CLIQUE), index, PolicyName.FIRST_FIT, largest_clique=18
    )
    assert first == PlacementPlan((("whole", 4),))


def test_split_takes_whole_blocks_then_best_fits_the_rest() -> None:
    cliques = [CliqueFree(f"r{i}", free, 18, (i,)) for i, free in enumerate([18, 18, 7, 12, 3])]
    index = CliqueIndex.from_cliques(cliques)
    outcome = policies.plan(
        Demand(40, Mode.PREFER_SINGLE_CLIQUE), index, PolicyName.BEST_FIT, largest_clique=18
    )
    assert isinstance(outcome, PlacementPlan)
    # 18 + 18 whole, the remaining 4 go to the 7-free clique (the smallest that holds 4).
    assert sorted(outcome.parts) == [("r0", 18), ("r1", 18), ("r2", 4)]


def test_segments_stay_inside_cliques() -> None:
    cliques = [CliqueFree(f"r{i}", free, 18, (i,)) for i, free in enumerate([10, 10, 10, 18])]
    index = CliqueIndex.from_cliques(cliques)
    outcome = policies.plan(
        Demand(27, Mode.ALLOW_SPLIT, segment_size=9), index, PolicyName.BEST_FIT, largest_clique=18
    )
    assert isinstance(outcome, PlacementPlan)
    assert [count for _, count in outcome.parts] == [9, 9, 9]
    assert _taken(outcome)["r3"] == 18
    # 30 nodes free, but no clique holds a segment of 18.
    too_fragmented = policies.plan(
        Demand(18, Mode.ALLOW_SPLIT, segment_size=18),
        CliqueIndex.from_cliques(cliques[:3]),
        PolicyName.BEST_FIT,
        largest_clique=18,
    )
    assert isinstance(too_fragmented, Infeasible) and too_fragmented.reason is Reason.FRAGMENTED


def test_spread_is_topology_blind() -> None:
    cliques = [CliqueFree(f"r{i}", 18, 18, (i,)) for i in range(4)]
    outcome = policies.plan(
        Demand(4, Mode.PREFER_SINGLE_CLIQUE),
        CliqueIndex.from_cliques(cliques),
        PolicyName.SPREAD,
        largest_clique=18,
    )
    assert isinstance(outcome, PlacementPlan)
    assert len(outcome.cliques) == 4


@given(st.lists(st.tuples(st.integers(0, 18), st.integers(1, 18)), max_size=30))
def test_fragmentation_is_zero_for_whole_blocks_and_bounded(pairs) -> None:
    pairs = [(min(f, s), s) for f, s in pairs]
    value = policies.fragmentation_of(pairs)
    assert 0.0 <= value <= 1.0
    assert policies.fragmentation_of([(s, s) for _, s in pairs]) == 0.0


def test_fragmentation_grows_as_free_nodes_scatter() -> None:
    whole = policies.fragmentation_of([(18, 18), (0, 18)])
    halves = policies.fragmentation_of([(9, 18), (9, 18)])
    crumbs = policies.fragmentation_of([(1, 18)] * 18)
    assert whole == 0.0 < halves < crumbs < 1.0


@given(st.lists(st.tuples(st.integers(0, 10), st.integers(1, 3)), min_size=1, max_size=8))
def test_pick_nodes_never_repeats_a_node(parts) -> None:
    names = {f"c{i}": [f"c{i}-n{j}" for j in range(30)] for i in range(4)}
    plan = PlacementPlan(tuple((f"c{c % 4}", k) for c, k in parts))
    segments = policies.pick_nodes(plan, names)
    picked = [n for s in segments for n in s.node_names]
    assert len(picked) == len(set(picked))
    assert all(n.startswith(s.clique_id + "-") for s in segments for n in s.node_names)


def test_split_prefers_the_smallest_blocks_that_still_need_fewest_cliques() -> None:
    cliques = [CliqueFree(f"r{i}", free, 18, (i,)) for i, free in enumerate([18, 18, 12, 12, 6])]
    outcome = policies.plan(
        Demand(24, Mode.PREFER_SINGLE_CLIQUE),
        CliqueIndex.from_cliques(cliques),
        PolicyName.BEST_FIT,
        largest_clique=18,
    )
    assert isinstance(outcome, PlacementPlan)
    # Two cliques either way; two 12-free cliques rather than a whole free rack and the 6.
    assert sorted(outcome.parts) == [("r2", 12), ("r3", 12)]
