"""The downsampler keeps spikes: every bucket's min and max are the true min and max of the
points it covers, the bucket count is bounded, and no point is lost or counted twice."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tuneplane.coordinator.downsample import DownsampleError, downsample, every_point

values = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False, width=64),
    st.just(math.nan),
    st.just(math.inf),
    st.just(-math.inf),
)
rows = st.lists(st.tuples(st.integers(-(10**12), 10**12), values), min_size=1, max_size=300)


@given(rows, st.integers(1, 64))
def test_buckets_keep_true_min_max_last_and_are_bounded(
    points: list[tuple[int, float]], max_buckets: int
) -> None:
    data = [(step, arrival, value) for arrival, (step, value) in enumerate(points)]
    lo = min(s for s, _, _ in data)
    hi = max(s for s, _, _ in data)
    buckets = downsample(iter(data), lo, hi, max_buckets)
    assert 1 <= len(buckets) <= max_buckets
    assert sum(b.count for b in buckets) == len(data)
    for prev, nxt in itertools.pairwise(buckets):
        assert prev.last_step < nxt.first_step
    for b in buckets:
        covered = [(s, a, v) for s, a, v in data if b.first_step <= s <= b.last_step]
        assert len(covered) == b.count
        assert min(s for s, _, _ in covered) == b.first_step
        assert max(s for s, _, _ in covered) == b.last_step
        real = [v for _, _, v in covered if not math.isnan(v)]
        if real:
            assert b.min == min(real) and b.max == max(real)
        else:
            assert math.isnan(b.min) and math.isnan(b.max)
        last = max(covered, key=lambda r: (r[0], r[1]))[2]
        assert b.last == last or (math.isnan(b.last) and math.isnan(last))


def test_a_single_spike_survives_a_million_to_ten_reduction() -> None:
    data = ((step, step, 100.0 if step == 654_321 else 1.0) for step in range(1_000_000))
    buckets = downsample(data, 0, 999_999, 10)
    assert len(buckets) == 10
    assert max(b.max for b in buckets) == 100.0
    assert sum(1 for b in buckets if b.max == 100.0) == 1


def test_every_point_orders_by_step_then_arrival() -> None:
    got = every_point([(5, 2, 1.0), (3, 9, 2.0), (5, 1, 3.0)])
    assert [(b.first_step, b.last) for b in got] == [(3, 2.0), (5, 3.0), (5, 1.0)]


def test_bad_arguments_are_named() -> None:
    with pytest.raises(DownsampleError, match="at least one bucket"):
        downsample([], 0, 1, 0)
    with pytest.raises(DownsampleError, match="outside the step range"):
        downsample([(7, 0, 1.0)], 0, 5, 3)
