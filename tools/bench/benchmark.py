"""What a benchmark of the suite is: its module and arguments, its metrics (with targets) and extra
figures, each read out of the benchmark's JSON result with the settings it was measured at."""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

Raw = Mapping[str, Any]


@dataclass(frozen=True)
class Metric:
    name: str
    unit: str
    target: str  # the project's target, as docs/benchmarks.md states it
    threshold: float
    at_most: bool  # True: value <= threshold meets the target; False: value >= threshold
    extract: Callable[[Raw], float]
    method: str
    # What this metric measures beyond its benchmark's settings (e.g. the RPC shape).
    settings: Mapping[str, Any] = field(default_factory=dict)
    # The extra figure, measured in the same run, below which this one cannot go (its floor).
    floor: str = ""

    def met(self, value: float) -> bool:
        compare = operator.le if self.at_most else operator.ge
        return bool(compare(value, self.threshold))


@dataclass(frozen=True)
class Extra:
    """A figure reported beside the targets (no target of its own)."""

    name: str
    unit: str
    extract: Callable[[Raw], float]
    method: str
    settings: Mapping[str, Any] = field(default_factory=dict)


def own_settings(raw: Raw) -> Mapping[str, Any]:
    """The settings a benchmark wrote into its result."""
    return dict(raw["settings"])


@dataclass(frozen=True)
class Benchmark:
    name: str
    module: str
    full_args: tuple[str, ...]
    quick_args: tuple[str, ...]
    full_timeout_s: float
    quick_timeout_s: float
    metrics: tuple[Metric, ...]
    extras: tuple[Extra, ...] = ()
    # Argument naming a PNG the benchmark draws (the runner passes a path), if any.
    plot_arg: str = ""
    plot_name: str = ""
    summary: str = ""
    # The settings the run was measured at, read from its result.
    settings: Callable[[Raw], Mapping[str, Any]] = own_settings


def get_path(raw: Raw, *path: str | int) -> Any:
    value: Any = raw
    for key in path:
        value = value[key]
    return value


def at(*path: str | int) -> Callable[[Raw], float]:
    """Extract the number at `path` of the result."""
    return lambda raw: float(get_path(raw, *path))
