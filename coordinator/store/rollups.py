"""The SQL of metric rollups: the ``metric_rollups`` table, its upkeep and the bucketed read.

Rules:
- A row summarises one block of one series' visible points (:mod:`~tuneplane.coordinator.
  rollup_blocks` says which steps a block holds and how a read uses them); a block with no
  visible point has no row. Orphaned points are in no summary.
- Every write that changes which points are visible recomputes the blocks over the steps it
  touched, from the level below, in the same transaction as the points (:func:`refresh`): a
  duplicate or retried batch, a late point into an old block and a restart mark all leave the
  summaries equal to what the points give, because they are recomputed, never adjusted.
- Portable SQL (SQLite and PostgreSQL): ``?`` placeholders, ``INSERT ... ON CONFLICT``,
  standard aggregates, integer division with an explicit floor for negative steps.
- The read (:func:`read_buckets`) runs in whatever snapshot its ``fetch`` gives it; the caller
  keeps it to one read transaction so summaries and points agree.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, cast

from ..downsample import Bucket
from ..rollup_blocks import (
    FANOUT,
    LEVELS,
    BlockRow,
    Fold,
    Grid,
    plan,
    refresh_runs,
)
from .handle import Handle

#: ``fetch(sql, args)``: the rows of one read statement.
Fetch = Callable[[str, Sequence[Any]], Iterable[Sequence[Any]]]

TABLE = """CREATE TABLE metric_rollups (
    series_id INTEGER NOT NULL REFERENCES metric_series(id),
    level INTEGER NOT NULL,
    block BIGINT NOT NULL,
    points BIGINT NOT NULL,
    first_step BIGINT NOT NULL,
    last_step BIGINT NOT NULL,
    min_value DOUBLE PRECISION,
    max_value DOUBLE PRECISION,
    PRIMARY KEY (series_id, level, block)
)"""

_COLUMNS = "series_id, level, block, points, first_step, last_step, min_value, max_value"
_UPSERT = (
    " ON CONFLICT (series_id, level, block) DO UPDATE SET points = excluded.points, "
    "first_step = excluded.first_step, last_step = excluded.last_step, "
    "min_value = excluded.min_value, max_value = excluded.max_value"
)
# An IN list is sent in chunks of at most this many values, padded to a power of two so a few
# statement texts serve every read.
IN_CHUNK = 1024


def _floor_div(column: str, divisor: int) -> str:
    """``floor(column / divisor)`` in SQL, whose integer division truncates toward zero."""
    return f"({column} / {divisor} - CASE WHEN {column} % {divisor} < 0 THEN 1 ELSE 0 END)"


def _level_one(where: str) -> str:
    block = _floor_div("step", FANOUT)
    return (
        f"INSERT INTO metric_rollups ({_COLUMNS}) SELECT series_id, 1, {block}, COUNT(*), "
        "MIN(step), MAX(step), MIN(value), MAX(value) FROM metric_points "
        f"WHERE orphaned = 0{where} GROUP BY series_id, {block}"
    )


def _level_up(where: str) -> str:
    parent = _floor_div("block", FANOUT)
    return (
        f"INSERT INTO metric_rollups ({_COLUMNS}) SELECT series_id, level + 1, {parent}, "
        "SUM(points), MIN(first_step), MAX(last_step), MIN(min_value), MAX(max_value) "
        f"FROM metric_rollups WHERE {where} GROUP BY series_id, level, {parent}"
    )


# Upkeep: (series id, first step, last step) for level 1, and (level below, series id, first
# child block, last child block) above it.
_REFRESH_LEVEL_ONE = _level_one(" AND series_id = ? AND step BETWEEN ? AND ?") + _UPSERT
_REFRESH_LEVEL_UP = _level_up("level = ? AND series_id = ? AND block BETWEEN ? AND ?") + _UPSERT
_DELETE_RUN = (
    "DELETE FROM metric_rollups WHERE level = ? AND series_id = ? AND block BETWEEN ? AND ?"
)


def build_statements() -> tuple[str, ...]:
    """Summaries of every series from its visible points, into an empty ``metric_rollups``:
    the backfill of the migration that adds the table, and a rebuild after ``DELETE``."""
    return (
        _level_one(""),
        *(_level_up(f"level = {level - 1}") for level in range(2, LEVELS + 1)),
    )


def migration() -> tuple[str, ...]:
    """The statements of the telemetry schema version that adds rollups (backfilled)."""
    return (TABLE, *build_statements())


async def refresh(db: Handle, changed: Sequence[tuple[int, int, int]], hidden: bool) -> None:
    """Recompute the blocks over ``changed`` (series id, first step, last step) from the points
    now visible, inside the caller's transaction. ``hidden``: points there may have stopped
    being visible, so blocks left with none are deleted first."""
    runs = [
        (level, series_id, first, last)
        for series_id, lo, hi in changed
        for level, first, last in refresh_runs([(lo, hi)])
    ]
    if not runs:
        return
    runs.sort(key=lambda r: r[0])  # each level is computed from the one below it
    if hidden:
        await db.executemany(_DELETE_RUN, runs)
    await db.executemany(
        _REFRESH_LEVEL_ONE,
        [
            (s, first * FANOUT, last * FANOUT + FANOUT - 1)
            for level, s, first, last in runs
            if level == 1
        ],
    )
    await db.executemany(
        _REFRESH_LEVEL_UP,
        [
            (level - 1, s, first * FANOUT, last * FANOUT + FANOUT - 1)
            for level, s, first, last in runs
            if level > 1
        ],
    )


def _marks(count: int) -> str:
    return ",".join("?" * count)


def _in_chunks(fetch: Fetch, sql: str, head: Sequence[Any], values: Sequence[int]) -> Iterator[Any]:
    """Rows of ``sql`` (whose last ``IN ({})`` takes ``values``) over chunks of ``values``."""
    for start in range(0, len(values), IN_CHUNK):
        part = list(values[start : start + IN_CHUNK])
        size = 1 << (len(part) - 1).bit_length()
        part += [part[-1]] * (size - len(part))
        yield from fetch(sql.format(_marks(size)), [*head, *part])


def read_buckets(
    fetch: Fetch,
    series_ids: Sequence[int],
    lo: int,
    hi: int,
    max_buckets: int,
    window: bool = False,
) -> list[Bucket]:
    """The buckets :func:`~tuneplane.coordinator.downsample.downsample` makes of the visible
    points of ``series_ids`` over ``[lo, hi]`` (their lowest and highest step), from rollups.
    ``window``: ``[lo, hi]`` is part of the series' steps (a zoom); points outside it are left
    out (:func:`~tuneplane.coordinator.rollup_blocks.plan`)."""
    grid = Grid.over(lo, hi, max_buckets)
    todo = plan(grid, window)
    fold = Fold(grid)
    series = _marks(len(series_ids))
    summary = "points, first_step, last_step, min_value, max_value"
    level, first, last = todo.top
    rows = fetch(
        f"SELECT block, {summary} FROM metric_rollups WHERE series_id IN ({series}) "
        "AND level = ? AND block BETWEEN ? AND ?",
        [*series_ids, level, first, last],
    )
    fold.blocks(cast(BlockRow, r[1:]) for r in rows if r[0] not in todo.top_split)
    below = (
        f"SELECT {summary} FROM metric_rollups WHERE series_id IN ({series}) AND level = ? "
        "AND block IN ({})"
    )
    for level, blocks in todo.levels:
        fold.blocks(_in_chunks(fetch, below, [*series_ids, level], blocks))
    points = (
        f"SELECT step, id, value FROM metric_points WHERE series_id IN ({series}) "
        "AND orphaned = 0 AND step IN ({})"
    )
    raw = list(_in_chunks(fetch, points, series_ids, todo.steps))
    fold.points((step, value) for step, _, value in raw)
    # Each bucket's last value: the latest arrival at its last step, as the raw read picks it.
    # A last step is often beside an edge, so its points were just read.
    steps = fold.last_steps()
    read = set(todo.steps)
    raw += _in_chunks(fetch, points, series_ids, [s for s in steps if s not in read])
    newest: dict[int, tuple[int, float]] = {}
    for step, arrival, value in raw:
        seen = newest.get(step)
        if seen is None or arrival > seen[0]:
            newest[step] = (arrival, math.nan if value is None else float(value))
    return fold.buckets([newest[step][1] for step in steps])
