"""The job trace of the gang placement benchmark and what it measures (pure: no I/O, no clock).

A trace is a seeded list of gangs (ComputeDomain jobs of 1 to 18 nodes, each wanting one NVLink
clique), each arriving at a time and holding its nodes for a while once all its pods are bound.
`Tally` turns samples of the cluster (free nodes per clique, the gangs still waiting) into the
figures the benchmark reports:

- stranded nodes: free nodes in cliques with fewer free nodes than the smallest gang waiting,
  i.e. nodes no waiting gang can use; integrated over time (node-seconds) while a gang waits;
- nodes held by part of a gang: bound pods of gangs not yet whole (a scheduler that binds a
  gang piecemeal can leave them so for good); integrated the same way. Both together are the
  nodes no waiting gang can use (`unusable_node_s`);
- the largest free block (most free nodes in one clique), its time average and minimum.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

MAX_GANG = 18  # one NVL72 rack's trays: no gang spans cliques


@dataclass(frozen=True, slots=True)
class Gang:
    index: int
    arrive_s: float  # after the trace's start
    size: int  # nodes (one pod per node)
    hold_s: float  # how long it keeps its nodes once all its pods are bound

    @property
    def name(self) -> str:
        return f"gang-{self.index:03d}"


def make_trace(
    seed: int, gangs: int, mean_gap_s: float, hold_s: tuple[float, float], largest: int = MAX_GANG
) -> list[Gang]:
    """`gangs` gangs of 1 to `largest` nodes, arriving with exponential gaps of mean `mean_gap_s`,
    each holding its nodes for a uniform time in `hold_s`. Sizes favour the middle and the full
    rack, as training jobs do: powers of two, 9 and 18 more often than the rest."""
    if gangs < 1 or mean_gap_s <= 0 or not 0 < hold_s[0] <= hold_s[1] or not 1 <= largest <= MAX_GANG:
        raise ValueError(
            f"a trace needs gangs >= 1, mean_gap_s > 0, 0 < hold_s[0] <= hold_s[1] and 1 <= largest <= {MAX_GANG}"
        )
    rng = random.Random(seed)
    favoured = (1, 2, 4, 8, 9, 16, 18)
    sizes = list(range(1, largest + 1))
    weights = [3.0 if s in favoured else 1.0 for s in sizes]
    out: list[Gang] = []
    now = 0.0
    for index in range(gangs):
        size = rng.choices(sizes, weights)[0]
        out.append(Gang(index, round(now, 3), size, round(rng.uniform(*hold_s), 3)))
        now += rng.expovariate(1.0 / mean_gap_s)
    return out


def stranded_nodes(free_by_clique: Mapping[str, int], smallest_waiting: int) -> int:
    """Free nodes in cliques too small for the smallest waiting gang (0 when none waits)."""
    if smallest_waiting <= 0:
        return 0
    return sum(free for free in free_by_clique.values() if free < smallest_waiting)


@dataclass
class Tally:
    """Accumulates samples; each sample holds for `dt_s` seconds."""

    stranded_node_s: float = 0.0
    waiting_s: float = 0.0  # time with at least one gang waiting
    largest_block_node_s: float = 0.0
    largest_block_min: int | None = None
    observed_s: float = 0.0
    stranded_max: int = 0
    partial_node_s: float = 0.0
    partial_max: int = 0
    # (t, stranded, held by part of a gang, largest free block), at each change
    timeline: list[tuple[float, int, int, int]] = field(default_factory=list)

    def sample(
        self,
        t_s: float,
        dt_s: float,
        free_by_clique: Mapping[str, int],
        waiting: Sequence[int],
        partial: int = 0,
    ) -> None:
        """One sample: free nodes per clique, the sizes of the gangs waiting, and how many nodes
        bound pods of gangs not yet whole hold."""
        if dt_s < 0:
            raise ValueError("samples go forward in time")
        largest = max(free_by_clique.values(), default=0)
        stranded = stranded_nodes(free_by_clique, min(waiting, default=0))
        self.observed_s += dt_s
        self.largest_block_node_s += largest * dt_s
        self.largest_block_min = (
            largest if self.largest_block_min is None else min(self.largest_block_min, largest)
        )
        if waiting:
            self.waiting_s += dt_s
            self.stranded_node_s += stranded * dt_s
            self.stranded_max = max(self.stranded_max, stranded)
            self.partial_node_s += partial * dt_s
            self.partial_max = max(self.partial_max, partial)
        if not self.timeline or self.timeline[-1][1:] != (stranded, partial, largest):
            self.timeline.append((round(t_s, 2), stranded, partial, largest))

    def summary(self) -> dict[str, float | int]:
        observed = self.observed_s or 1.0
        waiting = self.waiting_s or 1.0
        return {
            "stranded_node_s": round(self.stranded_node_s, 1),
            "stranded_mean_while_waiting": round(self.stranded_node_s / waiting, 2),
            "stranded_max": self.stranded_max,
            "partial_node_s": round(self.partial_node_s, 1),
            "partial_max": self.partial_max,
            "unusable_node_s": round(self.stranded_node_s + self.partial_node_s, 1),
            "waiting_s": round(self.waiting_s, 1),
            "largest_free_block_mean": round(self.largest_block_node_s / observed, 2),
            "largest_free_block_min": self.largest_block_min or 0,
            "observed_s": round(self.observed_s, 1),
        }


def fewer_stranded(native_node_s: float, ours_node_s: float) -> float:
    """The fraction of the native scheduler's stranded (or unusable) node-seconds that ours avoids (1.0: none
    left; 0: as many; negative: more). A native run that stranded nothing leaves nothing to avoid: 0."""
    if native_node_s <= 0:
        return 0.0
    return round(1.0 - ours_node_s / native_node_s, 3)
