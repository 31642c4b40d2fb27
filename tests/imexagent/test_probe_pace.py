"""How often a daemon is probed, with a fake clock: what happens soon after a start is seen soon,
and a daemon that takes its time is not probed every few milliseconds meanwhile."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.imexagent.probe_pace import ProbePace

FAST, SLOW = 0.025, 1.0


def probe_times(pace: ProbePace, start: float, until: float, settled_ready: bool = False) -> list[float]:
    """The probes the runner makes from a fresh event at `start` (a probe at once, then paced)."""
    times, now = [], start
    while now <= until:
        times.append(now)
        now += pace.interval(now, settled_ready)
    return times


@given(
    start=st.floats(0, 1e6),
    event_after=st.floats(0, 5.0),
    growth=st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0]),
)
def test_an_event_after_a_fresh_start_is_seen_within_the_growing_bound(
    start: float, event_after: float, growth: float
) -> None:
    pace = ProbePace(FAST, SLOW, window_s=2.0, growth=growth)
    pace.fresh(start)
    event = start + event_after
    seen = next(t for t in probe_times(pace, start, event + SLOW + 1) if t >= event)
    bound = max(FAST, growth * event_after) if event_after < 2.0 else SLOW
    assert seen - event <= min(bound, SLOW) + 1e-6 * max(1.0, start)


def test_the_fresh_window_costs_logarithmically_many_probes() -> None:
    pace = ProbePace(FAST, SLOW, window_s=2.0, growth=0.25)
    pace.fresh(100.0)
    in_window = [t for t in probe_times(pace, 100.0, 102.0) if t < 102.0]
    # Linear in the window at the fast interval would be 80 probes.
    bound = 1 / 0.25 + 1 + math.log(2.0 / FAST) / math.log(1.25)
    assert len(in_window) <= bound
    assert in_window[:4] == pytest.approx([100.0, 100.025, 100.05, 100.075])


def test_outside_the_window_ready_is_slow_and_waiting_is_calmer() -> None:
    pace = ProbePace(FAST, SLOW, window_s=2.0)
    pace.fresh(0.0)
    assert pace.interval(5.0, settled_ready=True) == SLOW
    assert pace.interval(5.0, settled_ready=False) == pytest.approx(0.25)
    # Never fresh: the same.
    assert ProbePace(FAST, SLOW).interval(0.0, settled_ready=True) == SLOW
    # A host of many simulated nodes waits longer between probes of a waiting daemon; never
    # longer than the settled pace, never shorter than the fast one.
    assert ProbePace(FAST, SLOW, waiting=0.5).interval(5.0, settled_ready=False) == pytest.approx(0.5)
    assert ProbePace(FAST, SLOW, waiting=3.0).interval(5.0, settled_ready=False) == SLOW
    assert ProbePace(0.3, SLOW, waiting=0.1).interval(5.0, settled_ready=False) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="waiting interval must be > 0"):
        ProbePace(FAST, SLOW, waiting=0.0)


def test_a_new_fresh_event_starts_the_fast_pace_again() -> None:
    pace = ProbePace(FAST, SLOW, window_s=2.0, growth=0.25)
    pace.fresh(0.0)
    assert pace.interval(1.9, settled_ready=True) == pytest.approx(0.475)
    pace.fresh(1.9)  # a SIGUSR1
    assert pace.interval(1.9, settled_ready=True) == FAST


@pytest.mark.parametrize(("fast", "slow"), [(0.0, 1.0), (2.0, 1.0), (-1.0, 1.0)])
def test_bad_intervals_are_refused_by_name(fast: float, slow: float) -> None:
    with pytest.raises(ValueError, match="fast <= slow"):
        ProbePace(fast, slow)
