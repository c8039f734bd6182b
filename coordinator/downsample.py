"""Downsampling a metric series into a bounded number of buckets that keep its spikes.

Rules:
- The step range ``[lo, hi]`` is cut into ``n = min(max_buckets, hi - lo + 1)`` equal intervals;
  a point at ``step`` lands in bucket ``(step - lo) * n // (hi - lo + 1)``. Empty buckets are
  left out, so at most ``max_buckets`` come back, in step order.
- A bucket keeps its count, first and last step, min and max (NaN ignored; NaN when every value
  is NaN) and last: the value at the largest step, the latest arrival among equal steps.
- Pure functions over rows ``(step, arrival, value)`` in any order: the store feeds them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs

Row = tuple[int, int, float]
INF = math.inf


class DownsampleError(ValueError):
    """The arguments cannot describe a series (an empty step range, no buckets)."""


@attrs.frozen(slots=True)
class Bucket:
    """Points with steps in ``[first_step, last_step]``."""

    first_step: int
    last_step: int
    count: int
    min: float
    max: float
    last: float


def downsample(rows: Iterable[Row], lo: int, hi: int, max_buckets: int) -> list[Bucket]:
    """Bucket ``rows`` whose steps all lie in ``[lo, hi]`` into at most ``max_buckets``."""
    if max_buckets < 1:
        raise DownsampleError(f"max_buckets is {max_buckets}; ask for at least one bucket")
    if hi < lo:
        raise DownsampleError(f"the step range [{lo}, {hi}] is empty; lo must not exceed hi")
    span = hi - lo + 1
    n = min(max_buckets, span)
    counts = [0] * n
    firsts = [0] * n
    lasts = [0] * n
    last_arrival = [0] * n
    last_values = [0.0] * n
    mins = [INF] * n
    maxs = [-INF] * n
    for step, arrival, value in rows:
        if step < lo or step > hi:
            raise DownsampleError(f"step {step} lies outside the step range [{lo}, {hi}]")
        b = (step - lo) * n // span
        if counts[b] == 0:
            firsts[b] = step
            lasts[b] = step
            last_arrival[b] = arrival
            last_values[b] = value
        else:
            if step < firsts[b]:
                firsts[b] = step
            if step > lasts[b] or (step == lasts[b] and arrival > last_arrival[b]):
                lasts[b] = step
                last_arrival[b] = arrival
                last_values[b] = value
        counts[b] += 1
        # NaN compares false both ways, so it never moves min or max.
        if value < mins[b]:
            mins[b] = value
        if value > maxs[b]:
            maxs[b] = value
    out: list[Bucket] = []
    for b in range(n):
        if not counts[b]:
            continue
        low, high = mins[b], maxs[b]
        if low > high:  # only NaN landed here (an infinite value would have moved one of them)
            low = high = math.nan
        out.append(Bucket(firsts[b], lasts[b], counts[b], low, high, last_values[b]))
    return out


def every_point(rows: Iterable[Row]) -> list[Bucket]:
    """A series small enough to return whole: one bucket per point, in (step, arrival) order."""
    ordered = sorted(rows, key=lambda row: (row[0], row[1]))
    return [Bucket(step, step, 1, value, value, value) for step, _, value in ordered]
