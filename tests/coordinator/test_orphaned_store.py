"""The telemetry store honours restart marks whatever order points and marks arrive in, on a
real SQLite file: the visible series, the counters and the bounded reads equal what the pure
place rule keeps. Batches are split, shuffled and sent twice, as retries and side-by-side files
deliver them."""

from __future__ import annotations

import asyncio
import math
import random
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.store_backend import current
from tuneplane.coordinator.orphans import Restart, orphaned
from tuneplane.coordinator.store.telemetry import TelemetryStore
from tuneplane.coordinator.values.jobs import MemberKey
from tuneplane.coordinator.values.metrics import MetricSelector
from tuneplane.coordinator.values.telemetry import CollectorReport, ShippedPoint, ShippedRestart

FILES = (
    "tb/run/events.out.tfevents.1",
    "tb/run/events.out.tfevents.2",
    "tb/run/a.jsonl",
    "tb/other/events.out.tfevents.1",
)
TAGS = ("loss", "acc")
MEMBER = MemberKey("run-orphans", 1, 0)

points_st = st.lists(
    st.tuples(st.sampled_from(FILES), st.sampled_from(TAGS), st.integers(0, 30), st.integers(0, 9)),
    max_size=30,
    unique_by=lambda p: (p[0], p[2], p[1]),
)
marks_st = st.lists(
    st.tuples(
        st.sampled_from(FILES),
        st.integers(0, 31),
        st.integers(0, 9),
        st.none() | st.sets(st.sampled_from(TAGS), min_size=1).map(frozenset),
    ),
    max_size=4,
    unique_by=lambda m: (m[0], m[1]),
)


def expected(
    points: list[tuple[str, str, int, int]], marks: list[Restart]
) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for source, tag, offset, step in points:
        if not orphaned(marks, source, tag, offset, step):
            out.setdefault(tag, []).append((step, float(offset)))
    return {tag: sorted(v) for tag, v in out.items()}


async def stored(
    path: Path,
    points: list[tuple[str, str, int, int]],
    marks: list[Restart],
    seed: int,
) -> tuple[dict[str, list[tuple[int, float]]], dict[str, tuple[int, int, float]], int]:
    rng = random.Random(seed)
    shipped_points = [
        ShippedPoint(source, offset, 0, tag, step, 1.7e9 + step, float(offset))
        for source, tag, offset, step in points
    ]
    shipped_marks = [
        ShippedRestart(
            m.source_id, m.offset, m.step, None if m.tags is None else tuple(m.tags), None
        )
        for m in marks
    ]
    calls: list[tuple[list[ShippedPoint], list[ShippedRestart]]] = []
    for chunk in range(0, len(shipped_points), 4):
        calls.append((shipped_points[chunk : chunk + 4], []))
    for m in shipped_marks:
        calls.append(([], [m]))
    calls += rng.sample(calls, k=min(3, len(calls)))  # retried calls
    rng.shuffle(calls)
    store = await TelemetryStore.open(current().where(path, fresh=True))
    try:
        for batch, restarts in calls:
            await store.ship(MEMBER, batch, CollectorReport(), 0, restarts)
        selector = MetricSelector(MEMBER.run_id, attempt=1)
        _, tags = await store.list_tags(selector)
        series: dict[str, list[tuple[int, float]]] = {}
        summary: dict[str, tuple[int, int, float]] = {}
        for t in tags:
            result = await store.query_series(selector, t.tag, 10_000)
            series[t.tag] = sorted((b.first_step, b.last) for b in result.buckets)
            summary[t.tag] = (t.points, t.last_step, t.last_value)
            small = await store.query_series(selector, t.tag, 2)
            assert sum(b.count for b in small.buckets) == len(series[t.tag])
            if small.buckets:
                assert min(b.min for b in small.buckets) == min(v for _, v in series[t.tag])
        deliveries = await store.delivery(MEMBER.run_id)
        orphans = deliveries[0].orphaned_points if deliveries else 0
        return series, summary, orphans
    finally:
        await store.close()


@settings(max_examples=60, deadline=None)
@given(points_st, marks_st, st.integers(0, 2**16))
def test_any_arrival_order_leaves_what_the_rule_keeps(
    raw_points: list[tuple[str, str, int, int]],
    raw_marks: list[tuple[str, int, int, frozenset[str] | None]],
    seed: int,
) -> None:
    points = [(source, tag, offset, step) for source, tag, offset, step in raw_points]
    marks = [Restart(source, offset, step, tags) for source, offset, step, tags in raw_marks]
    want = expected(points, marks)
    with tempfile.TemporaryDirectory() as tmp:
        series, summary, orphans = asyncio.run(
            stored(Path(tmp) / "telemetry.db", points, marks, seed)
        )
    assert series == want
    for tag, values in want.items():
        count, last_step, last_value = summary[tag]
        assert count == len(values)
        assert last_step == max(step for step, _ in values)
        assert not math.isnan(last_value)
    assert orphans == len(points) - sum(len(v) for v in want.values())
