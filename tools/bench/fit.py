"""Growth of a cost with size: the least-squares exponent on log-log axes, and what it means."""

from __future__ import annotations

import math

# An exponent within this of its bound still counts as the bound (the noise of a shared machine).
TOLERANCE = 0.1


def fit_exponent(points: list[tuple[float, float]]) -> float:
    """k of value ~ c * size^k, least squares on log-log axes; ValueError with fewer than 2 sizes."""
    usable = [(math.log(x), math.log(y)) for x, y in points if x > 0 and y > 0]
    if len({x for x, _ in usable}) < 2:
        raise ValueError(f"a growth fit needs at least two sizes with positive values, got {points}")
    n = len(usable)
    mean_x = sum(x for x, _ in usable) / n
    mean_y = sum(y for _, y in usable) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in usable)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in usable)
    return sxy / sxx


def top_exponent(points: list[tuple[float, float]]) -> float:
    """The slope on log-log axes between the two largest sizes: how cost grows where it is largest
    (a fit over all sizes is pulled down by the fixed costs of the small ones)."""
    usable = sorted((x, y) for x, y in points if x > 0 and y > 0)
    if len({x for x, _ in usable}) < 2:
        raise ValueError(f"a growth fit needs at least two sizes with positive values, got {points}")
    (x1, y1), (x2, y2) = usable[-2], usable[-1]
    return (math.log(y2) - math.log(y1)) / (math.log(x2) - math.log(x1))


def scale_factor(points: list[tuple[float, float]], exponent: float) -> float:
    """c of value ~ c * size^k for a fitted k (the geometric mean of value / size^k)."""
    logs = [math.log(y) - exponent * math.log(x) for x, y in points if x > 0 and y > 0]
    return math.exp(sum(logs) / len(logs))


def verdict(exponent: float, bound: float) -> str:
    """'linear or better' when the exponent is at most `bound` (within TOLERANCE)."""
    return "linear or better" if exponent <= bound + TOLERANCE else "worse than linear"
