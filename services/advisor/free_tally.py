"""The fleet index's running totals over each clique's free nodes (pure).

Per clique the index keeps which nodes are free; this keeps what decisions read from those sets
without scanning them: the two fragmentation sums, a histogram of free counts per clique (its
largest key is the largest free block), and two `CliqueIndex`es, one of free nodes and one with
unhealthy-but-untaken nodes counted too (to tell UNHEALTHY_FABRIC from "does not fit").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from services.advisor.clique_index import CliqueFree, CliqueIndex
from services.advisor.policies import fragmentation, fragmentation_terms


@dataclass(slots=True)
class CliqueEntry:
    clique_id: str
    cluster: str
    nodes: set[str] = field(default_factory=set)
    free: set[str] = field(default_factory=set)
    sick_free: set[str] = field(default_factory=set)
    rank: tuple[object, ...] = ()
    # Last fragmentation terms added to the tally's sums for this clique.
    terms: tuple[int, float] = (0, 0.0)
    # `free` in node order, rebuilt after `free` changed (decisions read it, rarely change it).
    free_sorted: list[str] | None = None


class FreeTally:
    """Totals over the cliques' free sets; told of every clique whose sets changed (`retally`)."""

    def __init__(self) -> None:
        self.index = CliqueIndex()
        self.index_with_sick = CliqueIndex()
        self._free_histogram: Counter[int] = Counter()
        self._sum_free = 0
        self._sum_sq = 0.0

    def retally(self, clique: CliqueEntry) -> None:
        """Bring the totals in line with the clique's free sets as they are now."""
        old_free, old_sq = clique.terms
        free = len(clique.free)
        new = fragmentation_terms(free, len(clique.nodes))
        if new != clique.terms:
            self._sum_free += new[0] - old_free
            self._sum_sq += new[1] - old_sq
            clique.terms = new
        if old_free != free:
            if old_free:
                self._free_histogram[old_free] -= 1
                if self._free_histogram[old_free] <= 0:
                    del self._free_histogram[old_free]
            if free:
                self._free_histogram[free] += 1
        _put(self.index, clique, free)
        _put(self.index_with_sick, clique, free + len(clique.sick_free))

    def forget(self, clique_id: str) -> None:
        """The clique has no nodes left (retallied empty first)."""
        self.index.remove(clique_id)
        self.index_with_sick.remove(clique_id)

    @property
    def free_count(self) -> int:
        return self._sum_free

    def largest_free_block(self) -> int:
        return max(self._free_histogram, default=0)

    def fragmentation(self) -> float:
        return fragmentation(self._sum_free, self._sum_sq)

    def after_taking(self, cliques: Mapping[str, CliqueEntry], taken: Mapping[str, int]) -> tuple[float, int]:
        """(fragmentation, largest free block) if `taken[clique]` free nodes were taken from each clique."""
        s1, s2 = float(self._sum_free), self._sum_sq
        histogram = dict(self._free_histogram)
        for clique_id, count in taken.items():
            clique = cliques[clique_id]
            old_free = len(clique.free)
            new_free = max(old_free - count, 0)
            old_terms = clique.terms
            new_terms = fragmentation_terms(new_free, len(clique.nodes))
            s1 += new_terms[0] - old_terms[0]
            s2 += new_terms[1] - old_terms[1]
            if old_free:
                histogram[old_free] = histogram.get(old_free, 0) - 1
            if new_free:
                histogram[new_free] = histogram.get(new_free, 0) + 1
        largest = max((k for k, v in histogram.items() if v > 0), default=0)
        return fragmentation(s1, s2), largest


def _put(index: CliqueIndex, clique: CliqueEntry, free: int) -> None:
    current = index.entries.get(clique.clique_id)
    if free == 0:
        index.remove(clique.clique_id)
    elif (
        current is None
        or current.free != free
        or current.size != len(clique.nodes)
        or current.rank != clique.rank
    ):
        index.put(CliqueFree(clique.clique_id, free, len(clique.nodes), clique.rank))
