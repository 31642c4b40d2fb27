"""Free capacity per clique, bucketed by free count, so policies avoid scanning every clique.

Cliques with at least one free node sit in the bucket of their free count, each
bucket sorted by node order (rank). With at most a few hundred trays per
clique there are few buckets, so "the smallest clique that fits" or "the first
clique that fits" costs a walk over buckets, not over 500+ cliques. The
fleet index keeps one current as nodes come and go; a request with a
selector builds a small one from its filtered view (`from_cliques`).
"""

from __future__ import annotations

import bisect
import heapq
import random
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

RankKey = Any
"""Sort key giving the inventory order of cliques (FIRST_FIT walks in this order)."""


@dataclass(frozen=True, slots=True)
class CliqueFree:
    clique_id: str
    free: int
    # Nodes of the clique in the fleet index, free or not (the block size when all are free).
    size: int
    rank: RankKey


class CliqueIndex:
    def __init__(self) -> None:
        self.entries: dict[str, CliqueFree] = {}
        # free count -> sorted [(rank, clique id)]
        self._buckets: dict[int, list[tuple[RankKey, str]]] = {}
        self._keys: list[int] = []
        self._sizes: Counter[int] = Counter()
        self.total_free = 0

    @classmethod
    def from_cliques(cls, cliques: Iterable[CliqueFree]) -> CliqueIndex:
        index = cls()
        for clique in cliques:
            index.put(clique)
        return index

    def copy(self) -> CliqueIndex:
        """An independent index with the same content (buckets copied, entries shared: they are frozen)."""
        other = CliqueIndex()
        other.entries = dict(self.entries)
        other._buckets = {k: list(v) for k, v in self._buckets.items()}
        other._keys = list(self._keys)
        other._sizes = Counter(self._sizes)
        other.total_free = self.total_free
        return other

    # ---- updates ---------------------------------------------------------------------------

    def put(self, clique: CliqueFree) -> None:
        """Insert or replace a clique; one with no free node is removed."""
        old = self.entries.get(clique.clique_id)
        if old == clique:
            return
        if old is not None:
            self.remove(clique.clique_id)
        if clique.free <= 0:
            return
        self.entries[clique.clique_id] = clique
        bucket = self._buckets.get(clique.free)
        if bucket is None:
            bucket = self._buckets[clique.free] = []
            bisect.insort(self._keys, clique.free)
        bisect.insort(bucket, (clique.rank, clique.clique_id))
        self._sizes[clique.size] += 1
        self.total_free += clique.free

    def remove(self, clique_id: str) -> None:
        old = self.entries.pop(clique_id, None)
        if old is None:
            return
        bucket = self._buckets[old.free]
        item = (old.rank, clique_id)
        del bucket[bisect.bisect_left(bucket, item)]
        if not bucket:
            del self._buckets[old.free]
            del self._keys[bisect.bisect_left(self._keys, old.free)]
        self._sizes[old.size] -= 1
        if self._sizes[old.size] <= 0:
            del self._sizes[old.size]
        self.total_free -= old.free

    # ---- reads ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.entries)

    def most_free(self) -> int:
        return self._keys[-1] if self._keys else 0

    def histogram(self) -> list[tuple[int, int]]:
        """(free count, number of cliques with it), fewest free first."""
        return [(key, len(self._buckets[key])) for key in self._keys]

    def _bucket_keys_from(self, n: int) -> list[int]:
        return self._keys[bisect.bisect_left(self._keys, n) :]

    def count_fitting(self, n: int) -> int:
        return sum(len(self._buckets[k]) for k in self._bucket_keys_from(n))

    def best_fit(self, n: int, exclude: frozenset[str] | set[str] = frozenset()) -> CliqueFree | None:
        """Fewest free nodes >= n; ties: the fuller (larger) clique, then inventory order."""
        uniform = len(self._sizes) <= 1
        for key in self._bucket_keys_from(n):
            best: CliqueFree | None = None
            for _rank, cid in self._buckets[key]:
                if cid in exclude:
                    continue
                clique = self.entries[cid]
                if uniform:
                    return clique
                if best is None or clique.size > best.size:
                    best = clique
            if best is not None:
                return best
        return None

    def first_fit(self, n: int) -> CliqueFree | None:
        """The clique first in inventory order among those with >= n free."""
        heads = [self._buckets[k][0] for k in self._bucket_keys_from(n)]
        return self.entries[min(heads)[1]] if heads else None

    def worst_fit(self, n: int) -> CliqueFree | None:
        """The most free nodes (first in inventory order among equals), if >= n."""
        if not self._keys or self._keys[-1] < n:
            return None
        return self.entries[self._buckets[self._keys[-1]][0][1]]

    def random_fit(self, n: int, rng: random.Random) -> CliqueFree | None:
        keys = self._bucket_keys_from(n)
        count = sum(len(self._buckets[k]) for k in keys)
        if count == 0:
            return None
        pick = rng.randrange(count)
        for key in keys:
            bucket = self._buckets[key]
            if pick < len(bucket):
                return self.entries[bucket[pick][1]]
            pick -= len(bucket)
        raise AssertionError("unreachable: pick within count")

    def descending(self, n: int = 1, at_most: int | None = None) -> Iterator[CliqueFree]:
        """Cliques with n..at_most free, most free first (inventory order among equals)."""
        for key in reversed(self._bucket_keys_from(n)):
            if at_most is not None and key > at_most:
                continue
            for _, cid in self._buckets[key]:
                yield self.entries[cid]

    def by_rank(self, n: int = 1) -> Iterator[CliqueFree]:
        """Cliques with >= n free in inventory order."""
        buckets = [self._buckets[k] for k in self._bucket_keys_from(n)]
        for _, cid in heapq.merge(*buckets):
            yield self.entries[cid]

    def fitting(self, n: int) -> list[CliqueFree]:
        """Cliques with >= n free, fewest free first."""
        return [self.entries[cid] for k in self._bucket_keys_from(n) for _, cid in self._buckets[k]]
