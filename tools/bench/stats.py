"""Percentiles as every benchmark reports them."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0 < q <= 100) by nearest rank: the smallest of `values` that at
    least `q` % of them do not exceed (p99 of 1,000 latencies: the 990th smallest)."""
    if not values:
        raise ValueError("a percentile of no values")
    if not 0 < q <= 100:
        raise ValueError(f"percentile {q} is not in (0, 100]")
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered) / 100)) - 1]
