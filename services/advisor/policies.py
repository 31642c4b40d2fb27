"""Placement policies: which cliques get how many nodes (pure functions, no I/O, no clock).

Input is the free capacity per clique (`CliqueFree`); output is a `PlacementPlan` (clique and
node count per segment) or an `Infeasible` with a reason. Picking concrete node
names from a clique is `pick_nodes`; scoring and fragmentation are here too, so
that the service, the extender and the benchmark judge placements the same way.

Policies:
- BEST_FIT: the clique with the fewest free nodes that still holds the job (ties: the
  fuller clique, then node order), so large free blocks stay whole. Jobs larger
  than any free block take whole blocks largest-first and best-fit the remainder,
  which uses the fewest cliques possible.
- FIRST_FIT: the first clique in node order that holds the job, else walk the
  cliques in order.
- RANDOM: a random clique that holds the job, else walk the cliques in random order.
- SPREAD: topology-blind spreading (the baseline a scheduler without clique knowledge
  gives): nodes (or segments) go round-robin to the cliques with the most free
  nodes. Under REQUIRE_SINGLE_CLIQUE it takes the clique with the most free nodes.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from services.advisor.clique_index import CliqueFree, CliqueIndex
from services.advisor.model import Mode, PolicyName, Reason, Segment

__all__ = [
    "CliqueFree",
    "CliqueIndex",
    "Demand",
    "Infeasible",
    "PlacementPlan",
    "fragmentation",
    "fragmentation_of",
    "min_cliques_needed",
    "pick_nodes",
    "plan",
    "score",
]


@dataclass(frozen=True, slots=True)
class Demand:
    num_nodes: int
    mode: Mode
    # ALLOW_SPLIT only: nodes per segment, each segment inside one clique; 0 = any split.
    segment_size: int = 0

    @property
    def unit(self) -> int:
        """Nodes that must stay together in one clique when the job is split."""
        if self.mode is Mode.ALLOW_SPLIT and self.segment_size > 0:
            return self.segment_size
        return 1


@dataclass(frozen=True, slots=True)
class PlacementPlan:
    # One entry per output segment: (clique id, node count).
    parts: tuple[tuple[str, int], ...]

    @property
    def cliques(self) -> list[str]:
        return list(dict.fromkeys(clique for clique, _ in self.parts))

    @property
    def num_nodes(self) -> int:
        return sum(count for _, count in self.parts)


@dataclass(frozen=True, slots=True)
class Infeasible:
    reason: Reason
    message: str


# ---- single-clique choice ------------------------------------------------------------


def _choose_single(policy: PolicyName, index: CliqueIndex, n: int, rng: random.Random) -> CliqueFree | None:
    if policy is PolicyName.BEST_FIT:
        return index.best_fit(n)
    if policy is PolicyName.FIRST_FIT:
        return index.first_fit(n)
    if policy is PolicyName.RANDOM:
        return index.random_fit(n, rng)
    return index.worst_fit(n)


# ---- splitting over several cliques ---------------------------------------------------

Allocation = list[tuple[CliqueFree, int]]
"""(clique, units) with units = segments (or nodes when the unit is 1)."""


def _split_best_fit(index: CliqueIndex, units: int, unit: int) -> Allocation:
    """Fewest cliques, and among those the smallest blocks that still do it.

    With k = the fewest cliques that can hold the job, find the smallest block
    size M such that k blocks of at most M free nodes suffice; take the largest
    k-1 of those whole and best-fit the rest. A 24-node job then goes to two
    12-free cliques rather than a whole free rack plus 6, keeping whole racks
    for jobs that need them.
    """
    histogram = index.histogram()
    k = _fewest_cliques(histogram, units, unit)
    limit = None
    for bound, _ in histogram:
        if bound < unit:
            continue
        if _top_capacity(histogram, k, unit, bound) >= units:
            limit = bound
            break
    out: Allocation = []
    used: set[str] = set()
    remaining = units
    largest_first: Iterator[CliqueFree] = index.descending(unit, at_most=limit)
    while len(out) < k - 1:
        biggest = next(largest_first)
        cap = biggest.free // unit
        out.append((biggest, cap))
        used.add(biggest.clique_id)
        remaining -= cap
    holder = index.best_fit(remaining * unit, exclude=used)
    assert holder is not None, "the k-th block of at most `limit` free holds the rest"
    out.append((holder, remaining))
    return out


def _fewest_cliques(histogram: list[tuple[int, int]], units: int, unit: int) -> int:
    remaining = units
    used = 0
    for free, count in reversed(histogram):
        cap = free // unit
        if cap <= 0:
            break
        take = min(count, -(-remaining // cap))
        used += take
        remaining -= take * cap
        if remaining <= 0:
            return used
    return used


def _top_capacity(histogram: list[tuple[int, int]], k: int, unit: int, at_most: int) -> int:
    """Units the k largest blocks of at most `at_most` free nodes hold together."""
    total = 0
    taken = 0
    for free, count in reversed(histogram):
        if free > at_most:
            continue
        cap = free // unit
        if cap <= 0:
            break
        take = min(count, k - taken)
        total += take * cap
        taken += take
        if taken >= k:
            break
    return total


def _split_walk(ordered: Iterable[CliqueFree], units: int, unit: int) -> Allocation:
    out: Allocation = []
    remaining = units
    for clique in ordered:
        take = min(clique.free // unit, remaining)
        if take > 0:
            out.append((clique, take))
            remaining -= take
        if remaining == 0:
            break
    return out


def _split_spread(index: CliqueIndex, units: int, unit: int) -> Allocation:
    # Only the `units` roomiest cliques can receive a unit; each unit goes to the one with most room left.
    top = []
    for clique in index.descending(unit):
        top.append(clique)
        if len(top) >= units:
            break
    heap = [(-(c.free // unit), c.rank, i) for i, c in enumerate(top)]
    heapq.heapify(heap)
    taken: dict[int, int] = {}
    for _ in range(units):
        neg_cap, rank, i = heapq.heappop(heap)
        taken[i] = taken.get(i, 0) + 1
        if neg_cap + 1 < 0:
            heapq.heappush(heap, (neg_cap + 1, rank, i))
    return [(top[i], count) for i, count in taken.items()]


def _split(policy: PolicyName, index: CliqueIndex, units: int, unit: int, rng: random.Random) -> Allocation:
    if policy is PolicyName.BEST_FIT:
        return _split_best_fit(index, units, unit)
    if policy is PolicyName.SPREAD:
        return _split_spread(index, units, unit)
    if policy is PolicyName.FIRST_FIT:
        holder = index.first_fit(units * unit)
        if holder is not None:
            return [(holder, units)]
        return _split_walk(index.by_rank(unit), units, unit)
    holder = index.random_fit(units * unit, rng)
    if holder is not None:
        return [(holder, units)]
    shuffled = index.fitting(unit)
    rng.shuffle(shuffled)
    return _split_walk(shuffled, units, unit)


def _expand(allocation: Allocation, demand: Demand) -> PlacementPlan:
    if demand.mode is Mode.ALLOW_SPLIT and demand.segment_size > 0:
        parts = [(c.clique_id, demand.segment_size) for c, segments in allocation for _ in range(segments)]
    else:
        parts = [(c.clique_id, count * demand.unit) for c, count in allocation]
    return PlacementPlan(tuple(parts))


# ---- the entry point ---------------------------------------------------------------------


def plan(
    demand: Demand,
    index: CliqueIndex,
    policy: PolicyName,
    *,
    largest_clique: int,
    rng: random.Random | None = None,
) -> PlacementPlan | Infeasible:
    """Decide how many nodes of which cliques serve `demand`.

    `index` holds the free capacity of the candidate cliques; `largest_clique`
    is the size of the largest candidate clique, free or not, which tells "can
    never fit" (NO_SINGLE_CLIQUE_FIT) from "does not fit now" (FRAGMENTED).
    """
    gen = rng if rng is not None else random.Random(0)
    n = demand.num_nodes
    total = index.total_free
    if total < n:
        return Infeasible(Reason.NO_CAPACITY, f"{n} nodes requested but only {total} free")
    most_free = index.most_free()

    if demand.mode is Mode.REQUIRE_SINGLE_CLIQUE:
        if largest_clique < n:
            return Infeasible(
                Reason.NO_SINGLE_CLIQUE_FIT,
                f"no clique has {n} nodes (the largest has {largest_clique}); allow a split to place it",
            )
        chosen = _choose_single(policy, index, n, gen)
        if chosen is None:
            return Infeasible(
                Reason.FRAGMENTED,
                f"{total} nodes are free but at most {most_free} of them in one clique ({n} needed)",
            )
        return PlacementPlan(((chosen.clique_id, n),))

    if demand.mode is Mode.PREFER_SINGLE_CLIQUE:
        if most_free >= n and policy is not PolicyName.SPREAD:
            chosen = _choose_single(policy, index, n, gen)
            assert chosen is not None
            return PlacementPlan(((chosen.clique_id, n),))
        return _expand(_split(policy, index, n, 1, gen), demand)

    unit = demand.unit
    if unit > largest_clique:
        return Infeasible(
            Reason.NO_SINGLE_CLIQUE_FIT,
            f"a segment of {unit} nodes is larger than every clique (the largest has {largest_clique})",
        )
    units = n // unit
    room = sum((free // unit) * count for free, count in index.histogram()) if unit > 1 else total
    if room < units:
        return Infeasible(
            Reason.FRAGMENTED,
            f"{total} nodes are free but only {room} segment(s) of {unit} fit inside cliques ({units} needed)",
        )
    return _expand(_split(policy, index, units, unit, gen), demand)


def min_cliques_needed(histogram: Iterable[tuple[int, int]], demand: Demand) -> int:
    """The fewest cliques any placement of `demand` can use (0 if it cannot be placed).

    `histogram` gives (free count, number of cliques with that many free).
    """
    unit = demand.unit
    ordered = sorted(histogram)
    units = demand.num_nodes // unit
    k = _fewest_cliques(ordered, units, unit)
    return k if _top_capacity(ordered, k, unit, ordered[-1][0] if ordered else 0) >= units else 0


# ---- node names ------------------------------------------------------------------------


def pick_nodes(placement: PlacementPlan, free_nodes: Mapping[str, Sequence[str]]) -> tuple[Segment, ...]:
    """Concrete nodes for a plan: the first free nodes of each clique, in the order given."""
    offsets: dict[str, int] = {}
    segments = []
    for clique, count in placement.parts:
        start = offsets.get(clique, 0)
        names = tuple(free_nodes[clique][start : start + count])
        if len(names) != count:
            raise ValueError(
                f"plan takes {start + count} nodes of clique {clique}, only {len(names) + start} free"
            )
        offsets[clique] = start + count
        segments.append(Segment(clique, names))
    return tuple(segments)


# ---- judging a placement ------------------------------------------------------------------


def score(placement: PlacementPlan, free_of: Mapping[str, int], min_cliques: int) -> float:
    """0..100, higher is better.

    fill = nodes placed / free nodes of the cliques touched (100 % when the job
    takes exactly what those cliques had left, so no hole stays behind);
    cohesion = fewest cliques possible / cliques used. score = 100 * fill * cohesion.
    Best fit maximises it for single-clique jobs.
    """
    touched = placement.cliques
    free_touched = sum(free_of[c] for c in touched)
    if free_touched <= 0 or not touched:
        return 0.0
    fill = placement.num_nodes / free_touched
    cohesion = max(min_cliques, 1) / len(touched)
    return round(100.0 * min(fill, 1.0) * min(cohesion, 1.0), 3)


def fragmentation_terms(free: int, size: int) -> tuple[int, float]:
    """(free, free²/size): the two sums `fragmentation` is computed from, kept per clique."""
    return free, (free * free / size) if size > 0 else 0.0


def fragmentation(total_free: float, sum_sq_over_size: float) -> float:
    """Free-weighted mean of (1 - free/size) over cliques.

    0 when every free node sits in a wholly free clique; towards 1 when the free
    nodes are scattered as small remnants of busy cliques.
    """
    if total_free <= 0:
        return 0.0
    return max(0.0, min(1.0, 1.0 - sum_sq_over_size / total_free))


def fragmentation_of(pairs: Iterable[tuple[int, int]]) -> float:
    """`fragmentation` from (free, size) per clique."""
    s1 = 0.0
    s2 = 0.0
    for free, size in pairs:
        a, b = fragmentation_terms(free, size)
        s1 += a
        s2 += b
    return fragmentation(s1, s2)


def single_clique_candidates(
    demand: Demand, index: CliqueIndex, limit: int
) -> list[tuple[PlacementPlan, float]]:
    """The best `limit` one-clique placements by score, i.e. fewest free nodes first (for Explain)."""
    n = demand.num_nodes
    if demand.mode is Mode.ALLOW_SPLIT and demand.segment_size > 0 and n % demand.segment_size:
        return []
    best: list[CliqueFree] = []
    for clique in index.fitting(n):
        best.append(clique)
        if len(best) >= limit:
            break
    out = []
    for c in best:
        if demand.mode is Mode.ALLOW_SPLIT and demand.segment_size > 0:
            parts = tuple((c.clique_id, demand.segment_size) for _ in range(n // demand.segment_size))
        else:
            parts = ((c.clique_id, n),)
        out.append((PlacementPlan(parts), round(100.0 * n / c.free, 3)))
    return out
