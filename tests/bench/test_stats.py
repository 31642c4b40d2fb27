"""The one percentile every benchmark reports: nearest rank."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tools.bench.stats import percentile


def test_p99_of_a_thousand_latencies_is_the_990th_smallest() -> None:
    values = [float(v) for v in range(1000, 0, -1)]  # unordered input
    assert percentile(values, 99) == 990.0
    assert percentile(values, 50) == 500.0
    assert percentile(values, 100) == 1000.0


def test_small_samples_take_the_nearest_rank_upwards() -> None:
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0], 50) == 1.0
    assert percentile([1.0, 2.0], 51) == 2.0
    assert percentile([float(v) for v in range(1, 11)], 90) == 9.0


@pytest.mark.parametrize("q", [0, -1, 100.5])
def test_a_percentile_outside_0_to_100_is_refused(q: float) -> None:
    with pytest.raises(ValueError, match="not in"):
        percentile([1.0, 2.0], q)


def test_no_values_have_no_percentile() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)


@given(
    st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=1, max_size=200),
    st.floats(min_value=0.01, max_value=100),
)
def test_the_result_is_the_smallest_value_covering_q_percent(values: list[float], q: float) -> None:
    result = percentile(values, q)
    assert result in values
    covered = sum(v <= result for v in values)
    assert covered * 100 >= q * len(values)
    below = sum(v < result for v in values)
    assert below * 100 < q * len(values)
