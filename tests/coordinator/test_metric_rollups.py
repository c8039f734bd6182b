"""Rollups on a real telemetry store (a SQLite file, or a PostgreSQL database: every test here
runs on both): whatever arrives (duplicate and retried batches, points out of order, late
points into old blocks, restart marks that orphan points already stored or still to come), a
bucketed read equals the raw computation over the visible points exactly, and the stored
summaries equal those the visible points give. A store written by the schema before rollups is
migrated and backfilled to the same answers."""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import store_backend
from tests.support.store_backend import open_at_version, read, write
from tuneplane.coordinator.downsample import Bucket, downsample, every_point
from tuneplane.coordinator.rollup_blocks import LEVELS, width
from tuneplane.coordinator.store.telemetry import MIGRATIONS, TelemetryStore
from tuneplane.coordinator.store_location import Where
from tuneplane.coordinator.values.jobs import MemberKey
from tuneplane.coordinator.values.metrics import MetricSelector
from tuneplane.coordinator.values.telemetry import CollectorReport, ShippedPoint, ShippedRestart

SOURCES = ("tb/run/events.out.tfevents.1", "tb/run/events.out.tfevents.2", "metrics.jsonl")
TAGS = ("loss", "acc")
REPORT = CollectorReport()

values = st.one_of(
    st.floats(allow_nan=False, width=64),
    st.just(math.nan),
    st.just(math.inf),
    st.just(-math.inf),
)
# Narrow spans put many points in one block and one step; wide ones reach the top levels.
step_spaces = st.sampled_from([(0, 12), (-40, 200), (-(10**6), 10**6), (-(10**15), 10**15)])


@st.composite
def operations(draw: st.DrawFn) -> list[tuple[Any, ...]]:
    lo, hi = draw(step_spaces)
    steps = st.integers(lo, hi)
    ops: list[tuple[Any, ...]] = []
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["ship", "ship", "ship", "mark", "again"]))
        member = draw(st.integers(0, 1))
        source = draw(st.sampled_from(SOURCES))
        if kind == "ship":
            points = draw(
                st.lists(
                    st.tuples(st.integers(0, 60), st.sampled_from(TAGS), steps, values),
                    min_size=1,
                    max_size=25,
                )
            )
            ops.append(("ship", member, source, points))
        elif kind == "mark":
            tags = draw(st.none() | st.sets(st.sampled_from(TAGS), min_size=1).map(tuple))
            ops.append(("mark", member, source, draw(st.integers(0, 61)), draw(steps), tags))
        elif ops:
            ops.append(ops[draw(st.integers(0, len(ops) - 1))])  # a retried call
    return ops


async def apply(store: TelemetryStore, run: str, ops: list[tuple[Any, ...]]) -> None:
    for op in ops:
        member = MemberKey(run, 1, op[1])
        if op[0] == "ship":
            _, _, source, points = op
            shipped = [
                ShippedPoint(source, offset, index, tag, step, 1.7e9, value)
                for index, (offset, tag, step, value) in enumerate(points)
            ]
            await store.ship(member, shipped, REPORT, 0)
        else:
            _, _, source, offset, step, tags = op
            await store.ship(
                member, [], REPORT, 0, [ShippedRestart(source, offset, step, tags, None)]
            )


def key(buckets: list[Bucket]) -> list[tuple[object, ...]]:
    """Buckets compared bit for bit (NaN equal to NaN, every float by its repr)."""
    return [
        (b.first_step, b.last_step, b.count, repr(b.min), repr(b.max), repr(b.last))
        for b in buckets
    ]


def visible(where: Where, run: str) -> list[tuple[int, int, int, float | None]]:
    """(series id, step, arrival, value) of every visible point of ``run``."""
    return [
        (int(r[0]), int(r[1]), int(r[2]), None if r[3] is None else float(r[3]))
        for r in read(
            where,
            TelemetryStore,
            "SELECT p.series_id, p.step, p.id, p.value FROM metric_points p "
            "JOIN metric_series s ON s.id = p.series_id WHERE s.run_id = ? AND p.orphaned = 0",
            (run,),
        )
    ]


def summaries(points: list[tuple[int, int, int, float | None]]) -> dict[tuple[int, ...], Any]:
    """Every block summary the visible points give, computed here in Python."""
    out: dict[tuple[int, ...], list[Any]] = {}
    for series_id, step, _, value in points:
        for level in range(1, LEVELS + 1):
            s = out.setdefault(
                (series_id, level, step // width(level)), [0, step, step, None, None]
            )
            s[0] += 1
            s[1] = min(s[1], step)
            s[2] = max(s[2], step)
            if value is not None:
                s[3] = value if s[3] is None else min(s[3], value)
                s[4] = value if s[4] is None else max(s[4], value)
    return {k: tuple(v) for k, v in out.items()}


def stored_summaries(where: Where, run: str) -> dict[tuple[int, ...], Any]:
    rows = read(
        where,
        TelemetryStore,
        "SELECT r.series_id, r.level, r.block, r.points, r.first_step, r.last_step, "
        "r.min_value, r.max_value FROM metric_rollups r "
        "JOIN metric_series s ON s.id = r.series_id WHERE s.run_id = ?",
        (run,),
    )
    return {
        (int(r[0]), int(r[1]), int(r[2])): (
            int(r[3]),
            int(r[4]),
            int(r[5]),
            None if r[6] is None else float(r[6]),
            None if r[7] is None else float(r[7]),
        )
        for r in rows
    }


def views(where: Where, run: str) -> Iterator[tuple[MetricSelector, str, set[int]]]:
    """Every read `tp metrics` can make of ``run``: each tag merged, and each series alone."""
    series = read(
        where,
        TelemetryStore,
        "SELECT id, member_index, source, tag FROM metric_series WHERE run_id = ? AND points > 0",
        (run,),
    )
    for tag, group in itertools.groupby(sorted(series, key=lambda r: r[3]), key=lambda r: r[3]):
        rows = list(group)
        yield MetricSelector(run, attempt=1), tag, {int(r[0]) for r in rows}
        for r in rows:
            selector = MetricSelector(run, raw=True, attempt=1, member_index=r[1], source=r[2])
            yield selector, tag, {int(r[0])}


async def check_exact(store: TelemetryStore, where: Where, run: str, counts: list[int]) -> None:
    """The stored summaries are the points' own, and every read equals the raw computation."""
    points = visible(where, run)
    assert stored_summaries(where, run) == summaries(points)
    for selector, tag, ids in views(where, run):
        rows = [
            (step, arrival, math.nan if v is None else v)
            for s, step, arrival, v in points
            if s in ids
        ]
        lo, hi = min(r[0] for r in rows), max(r[0] for r in rows)
        for n in counts:
            result = await store.query_series(selector, tag, n)
            assert result.total_points == len(rows)
            want = every_point(rows) if len(rows) <= n else downsample(rows, lo, hi, n)
            assert key(list(result.buckets)) == key(want), (selector, tag, n)


def fresh_run() -> str:
    return f"run-{uuid.uuid4().hex[:12]}"


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(operations(), st.lists(st.integers(1, 40), min_size=1, max_size=4))
def test_any_ingest_order_leaves_rollups_equal_to_the_raw_buckets(
    ops: list[tuple[Any, ...]], bucket_counts: list[int]
) -> None:
    run = fresh_run()  # on PostgreSQL the test's one database holds every example, apart

    async def go(where: Where) -> None:
        store = await TelemetryStore.open(where)
        try:
            await apply(store, run, ops)
            await check_exact(store, where, run, [*bucket_counts, 1, 2, 10_000])
        finally:
            await store.close()

    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(go(store_backend.current().where(Path(tmp) / "telemetry.db")))


def in_store(test: Any) -> None:
    """Run ``test(store, where, run)`` on a fresh store of the test's backend."""

    async def go(where: Where) -> None:
        store = await TelemetryStore.open(where)
        try:
            await test(store, where, fresh_run())
        finally:
            await store.close()

    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(go(store_backend.current().where(Path(tmp) / "telemetry.db", fresh=True)))


def test_a_late_point_into_an_old_block_moves_only_its_bucket() -> None:
    async def test(store: TelemetryStore, where: Where, run: str) -> None:
        member = MemberKey(run, 1, 0)
        evens = [ShippedPoint("m.jsonl", s, 0, "loss", s, None, 1.0) for s in range(0, 4000, 2)]
        await store.ship(member, evens, REPORT, 0)
        before = await store.query_series(MetricSelector(run), "loss", 10)
        # Step 1001 arrives last, far below the newest step, with a spike.
        late = [ShippedPoint("m.jsonl", 9999, 0, "loss", 1001, None, 50.0)]
        await store.ship(member, late, REPORT, 0)
        after = await store.query_series(MetricSelector(run), "loss", 10)
        changed = [
            i for i, (a, b) in enumerate(zip(before.buckets, after.buckets, strict=True)) if a != b
        ]
        assert changed == [2]
        assert after.buckets[2].max == 50.0 and after.buckets[2].count == 201
        await check_exact(store, where, run, [1, 3, 10, 333])

    in_store(test)


def test_a_duplicate_batch_changes_no_summary() -> None:
    async def test(store: TelemetryStore, where: Where, run: str) -> None:
        member = MemberKey(run, 1, 0)
        batch = [ShippedPoint("m.jsonl", s, 0, "loss", s, None, float(s)) for s in range(500)]
        await store.ship(member, batch, REPORT, 0)
        first = stored_summaries(where, run)
        # The same keys again, with other values: a retry the store must ignore.
        again = [ShippedPoint("m.jsonl", p.offset, 0, "loss", p.step, None, -1.0) for p in batch]
        result = await store.ship(member, again, REPORT, 0)
        assert result.duplicates == len(batch)
        assert stored_summaries(where, run) == first
        await check_exact(store, where, run, [1, 7, 499])

    in_store(test)


def test_a_restart_that_orphans_a_tail_removes_its_blocks() -> None:
    source = "tb/run/events.out.tfevents.1"

    async def test(store: TelemetryStore, where: Where, run: str) -> None:
        member = MemberKey(run, 1, 0)
        points = [ShippedPoint(source, s, 0, "loss", s, None, float(s)) for s in range(1000)]
        await store.ship(member, points, REPORT, 0)
        # The writer restarted at step 600: the old writer's steps 600.. are orphaned.
        await store.ship(member, [], REPORT, 0, [ShippedRestart(source, 5000, 600, None, None)])
        result = await store.query_series(MetricSelector(run), "loss", 7)
        assert sum(b.count for b in result.buckets) == 600
        assert result.buckets[-1].last_step == 599 and result.buckets[-1].last == 599.0
        # No summary still counts an orphaned point; blocks left empty are gone.
        assert max(s[2] for s in stored_summaries(where, run).values()) == 599
        await check_exact(store, where, run, [1, 2, 7, 100])

    in_store(test)


def test_equal_steps_across_series_keep_the_latest_arrival_as_last() -> None:
    async def test(store: TelemetryStore, where: Where, run: str) -> None:
        for member, value in ((1, 2.0), (0, 3.0)):  # member 0's points arrive second
            points = [ShippedPoint("m.jsonl", s, 0, "loss", s, None, value) for s in range(100)]
            await store.ship(MemberKey(run, 1, member), points, REPORT, 0)
        result = await store.query_series(MetricSelector(run), "loss", 10)
        assert [b.last for b in result.buckets] == [3.0] * 10
        assert all(b.count == 20 for b in result.buckets)
        await check_exact(store, where, run, [1, 3, 10, 99])

    in_store(test)


def test_a_store_from_before_rollups_is_migrated_and_backfilled_exactly() -> None:
    rng = random.Random(11)
    run = fresh_run()
    points = []
    for offset in range(20_000):
        member = rng.choice((0, 1))
        step = rng.randrange(-5_000, 60_000)
        value = rng.choice((None, math.inf, rng.uniform(-1e6, 1e6), rng.uniform(-1, 1)))
        points.append((member, offset, step, value, int(rng.random() < 0.1)))

    async def older(where: Where) -> None:
        store = await open_at_version(TelemetryStore, where, 2)
        await store.close()
        # Written as the coordinator before rollups wrote them: series, then points, some
        # orphaned, with the series counting only the others.
        for member in (0, 1):
            write(
                where,
                TelemetryStore,
                "INSERT INTO metric_series (run_id, attempt, member_index, source, tag) "
                "VALUES (?, 1, ?, 'm.jsonl', 'loss')",
                (run, member),
            )
        ids = dict(
            read(
                where,
                TelemetryStore,
                "SELECT member_index, id FROM metric_series WHERE run_id = ?",
                (run,),
            )
        )
        for start in range(0, len(points), 1000):
            chunk = points[start : start + 1000]
            write(
                where,
                TelemetryStore,
                "INSERT INTO metric_points (series_id, source_offset, value_index, step, "
                "wall_time, value, orphaned) VALUES "
                + ",".join(["(?, ?, 0, ?, NULL, ?, ?)"] * len(chunk)),
                [x for m, o, s, v, h in chunk for x in (ids[m], o, s, v, h)],
            )
        write(
            where,
            TelemetryStore,
            "UPDATE metric_series SET points = (SELECT COUNT(*) FROM metric_points p "
            "WHERE p.series_id = metric_series.id AND p.orphaned = 0) WHERE run_id = ?",
            (run,),
        )

    async def upgraded(where: Where) -> None:
        store = await TelemetryStore.open(where)
        try:
            assert await store.schema_version() == MIGRATIONS[-1][0] >= 3
            await check_exact(store, where, run, [1, 7, 1000, 4321])
            # Kept up from here on: a late point into a backfilled block, and a new one.
            more = [
                ShippedPoint("m.jsonl", 99_000 + i, 0, "loss", step, None, float(i))
                for i, step in enumerate((17, 70_000))
            ]
            await store.ship(MemberKey(run, 1, 0), more, REPORT, 0)
            await check_exact(store, where, run, [1, 7, 1000])
        finally:
            await store.close()

    with tempfile.TemporaryDirectory() as tmp:
        where = store_backend.current().where(Path(tmp) / "telemetry.db", fresh=True)
        asyncio.run(older(where))
        asyncio.run(upgraded(where))
