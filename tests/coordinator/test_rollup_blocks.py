"""The block arithmetic of metric rollups, pure: which blocks a write touches at every level,
how a read's buckets are laid over the steps, and that folding points gives exactly the
buckets the raw downsampler gives."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tuneplane.coordinator.downsample import Bucket, DownsampleError, downsample
from tuneplane.coordinator.rollup_blocks import (
    FANOUT,
    LEVELS,
    BlockRow,
    Fold,
    Grid,
    block_of,
    children,
    plan,
    refresh_runs,
    step_ranges,
    width,
)

steps_st = st.integers(-(10**15), 10**15)
small_steps = st.integers(-300, 300)
# No -0.0: the store keeps a zero unsigned (SQLite does; the store makes PostgreSQL do the same),
# and which signed zero a min keeps depends on reading order, on the raw path too.
values = st.one_of(st.floats(allow_nan=False, width=64).map(lambda v: v + 0.0), st.just(math.nan))


def blocks_in(runs: list[tuple[int, int, int]], level: int) -> set[int]:
    return {b for lv, first, last in runs if lv == level for b in range(first, last + 1)}


@given(st.lists(st.tuples(small_steps, st.integers(0, 40)), max_size=6))
def test_refresh_runs_hold_exactly_the_touched_blocks_level_by_level(
    spans: list[tuple[int, int]],
) -> None:
    ranges = [(lo, lo + extra) for lo, extra in spans]
    runs = refresh_runs(ranges)
    assert [r[0] for r in runs] == sorted(r[0] for r in runs)  # level 1 first, then upwards
    touched = {s for lo, hi in ranges for s in range(lo, hi + 1)}
    for level in range(1, LEVELS + 1):
        assert blocks_in(runs, level) == {block_of(s, level) for s in touched}
        level_runs = sorted((a, b) for lv, a, b in runs if lv == level)
        for (_, end), (start, _) in itertools.pairwise(level_runs):
            assert start > end + 1  # runs at one level never touch: each block once


def test_refresh_runs_of_nothing_is_nothing() -> None:
    assert refresh_runs([]) == []
    assert refresh_runs([(5, 4)]) == []


@given(st.lists(steps_st | small_steps, max_size=40))
def test_step_ranges_touch_the_same_level_one_blocks_as_the_steps(steps: list[int]) -> None:
    ranges = step_ranges(steps)
    assert all(lo <= hi for lo, hi in ranges)
    assert all(any(lo <= s <= hi for lo, hi in ranges) for s in steps)
    assert blocks_in(refresh_runs(ranges), 1) == {block_of(s, 1) for s in steps}


def test_blocks_floor_negative_steps() -> None:
    assert width(1) == FANOUT
    assert block_of(-1, 1) == -1
    assert block_of(-FANOUT, 1) == -1
    assert block_of(-FANOUT - 1, 1) == -2
    assert block_of(FANOUT - 1, 1) == 0
    assert children([-1]) == list(range(-FANOUT, 0))


@given(steps_st, st.integers(0, 10**6), st.integers(1, 10_000))
def test_the_grid_is_the_downsampler_s_buckets(lo: int, extent: int, max_buckets: int) -> None:
    hi = lo + extent
    grid = Grid.over(lo, hi, max_buckets)
    assert grid.n == min(max_buckets, extent + 1)
    for step in (lo, hi, lo + extent // 2, lo + extent // 3):
        expected = downsample([(step, 0, 1.0)], lo, hi, max_buckets)[0]
        assert grid.bucket(step) == (step - lo) * grid.n // grid.span
        assert expected.first_step == step
    level = grid.top_level()
    count = block_of(hi, level) - block_of(lo, level) + 1
    assert count <= FANOUT * grid.n or level == LEVELS
    if level > 1:
        below = block_of(hi, level - 1) - block_of(lo, level - 1) + 1
        assert below > FANOUT * grid.n


def test_the_grid_refuses_what_cannot_be_bucketed() -> None:
    with pytest.raises(DownsampleError, match="at least one bucket"):
        Grid.over(0, 1, 0)
    with pytest.raises(DownsampleError, match="lo must not exceed hi"):
        Grid.over(3, 2, 5)


def covering(grid: Grid) -> list[tuple[int, int]]:
    """The step ranges (clamped to the grid) the plan reads, as blocks and as single steps."""
    todo = plan(grid)
    level, first, last = todo.top
    blocks = [(level, b) for b in range(first, last + 1) if b not in todo.top_split]
    blocks += [(lv, b) for lv, bs in todo.levels for b in bs]
    out = [(max(b * width(lv), grid.lo), min((b + 1) * width(lv) - 1, grid.hi)) for lv, b in blocks]
    return [r for r in out if r[0] <= r[1]] + [(s, s) for s in todo.steps]


@settings(max_examples=300)
@given(st.integers(-(10**6), 10**6), st.integers(0, 3000), st.integers(1, 500))
def test_the_plan_covers_every_step_once_with_pieces_inside_one_bucket(
    lo: int, extent: int, max_buckets: int
) -> None:
    grid = Grid.over(lo, lo + extent, max_buckets)
    pieces = sorted(covering(grid))
    assert pieces[0][0] == grid.lo and pieces[-1][1] == grid.hi
    for (_, end), (start, _) in itertools.pairwise(pieces):
        assert start == end + 1  # no gap, no overlap
    for start, end in pieces:
        assert grid.bucket(start) == grid.bucket(end)


@given(steps_st, st.integers(0, 10**15), st.integers(1, 10_000))
def test_the_plan_stays_small_over_any_span(lo: int, extent: int, max_buckets: int) -> None:
    grid = Grid.over(lo, lo + extent, max_buckets)
    todo = plan(grid)
    level, first, last = todo.top
    assert last - first + 1 <= FANOUT * grid.n or level == LEVELS
    assert len(todo.top_split) < grid.n
    for _, blocks in todo.levels:
        assert len(blocks) <= FANOUT * grid.n
    assert len(todo.steps) <= FANOUT * grid.n


def summarise(rows: list[tuple[int, int, float]]) -> dict[tuple[int, int], BlockRow]:
    """Every block summary at every level, as the store keeps them."""
    out: dict[tuple[int, int], BlockRow] = {}
    for level in range(1, LEVELS + 1):
        groups: dict[int, list[tuple[int, int, float]]] = {}
        for r in rows:
            groups.setdefault(block_of(r[0], level), []).append(r)
        for block, inside in groups.items():
            real = [v for _, _, v in inside if not math.isnan(v)]
            out[(level, block)] = (
                len(inside),
                min(s for s, _, _ in inside),
                max(s for s, _, _ in inside),
                min(real) if real else None,
                max(real) if real else None,
            )
    return out


def same(a: list[Bucket], b: list[Bucket]) -> bool:
    def key(x: Bucket) -> tuple[object, ...]:
        return (x.first_step, x.last_step, x.count, repr(x.min), repr(x.max), repr(x.last))

    return [key(x) for x in a] == [key(x) for x in b]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(small_steps | steps_st, values), min_size=1, max_size=80),
    st.integers(1, 60),
)
def test_folding_the_planned_blocks_equals_the_raw_downsampler(
    points: list[tuple[int, float]], max_buckets: int
) -> None:
    rows = [(step, arrival, value) for arrival, (step, value) in enumerate(points)]
    lo, hi = min(r[0] for r in rows), max(r[0] for r in rows)
    want = downsample(rows, lo, hi, max_buckets)
    grid = Grid.over(lo, hi, max_buckets)
    todo = plan(grid)
    stored = summarise(rows)
    fold = Fold(grid)
    level, first, last = todo.top
    fold.blocks(
        row
        for (lv, b), row in sorted(stored.items())
        if lv == level and first <= b <= last and b not in todo.top_split
    )
    for lv, blocks in todo.levels:
        fold.blocks(stored[(lv, b)] for b in blocks if (lv, b) in stored)
    wanted = set(todo.steps)
    fold.points((s, None if math.isnan(v) else v) for s, _, v in rows if s in wanted)
    assert fold.last_steps() == [b.last_step for b in want]
    lasts = [max((r for r in rows if r[0] == b.last_step), key=lambda r: r[1])[2] for b in want]
    assert same(fold.buckets(lasts), want)


def _fold_planned(
    rows: list[tuple[int, int, float]], grid: Grid, window: bool
) -> tuple[Fold, list[int]]:
    """Fold what ``plan(grid, window)`` reads out of every summary of ``rows``."""
    todo = plan(grid, window)
    stored = summarise(rows)
    fold = Fold(grid)
    level, first, last = todo.top
    fold.blocks(
        row
        for (lv, b), row in sorted(stored.items())
        if lv == level and first <= b <= last and b not in todo.top_split
    )
    for lv, blocks in todo.levels:
        fold.blocks(stored[(lv, b)] for b in blocks if (lv, b) in stored)
    wanted = set(todo.steps)
    fold.points((s, None if math.isnan(v) else v) for s, _, v in rows if s in wanted)
    return fold, fold.last_steps()


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(small_steps, values), min_size=1, max_size=80),
    small_steps,
    st.integers(0, 400),
    st.integers(1, 60),
)
def test_a_window_folds_to_the_raw_downsampler_of_its_points_only(
    points: list[tuple[int, float]], lo: int, extent: int, max_buckets: int
) -> None:
    """A zoomed read: points on both sides of ``[lo, hi]`` stay out of its buckets."""
    rows = [(step, arrival, value) for arrival, (step, value) in enumerate(points)]
    hi = lo + extent
    inside = [r for r in rows if lo <= r[0] <= hi]
    want = downsample(inside, lo, hi, max_buckets)
    fold, last_steps = _fold_planned(rows, Grid.over(lo, hi, max_buckets), window=True)
    assert last_steps == [b.last_step for b in want]
    lasts = [max((r for r in rows if r[0] == b.last_step), key=lambda r: r[1])[2] for b in want]
    assert same(fold.buckets(lasts), want)


@settings(max_examples=300)
@given(st.integers(-(10**6), 10**6), st.integers(0, 3000), st.integers(1, 500))
def test_a_window_plan_reads_nothing_outside_its_range(
    lo: int, extent: int, max_buckets: int
) -> None:
    grid = Grid.over(lo, lo + extent, max_buckets)
    todo = plan(grid, window=True)
    level, first, last = todo.top
    blocks = [(level, b) for b in range(first, last + 1) if b not in todo.top_split]
    blocks += [(lv, b) for lv, bs in todo.levels for b in bs]
    pieces = sorted(
        [(b * width(lv), (b + 1) * width(lv) - 1) for lv, b in blocks]
        + [(s, s) for s in todo.steps]
    )
    assert pieces[0][0] == grid.lo and pieces[-1][1] == grid.hi  # unclamped: nothing past them
    for (_, end), (start, _) in itertools.pairwise(pieces):
        assert start == end + 1
    for start, end in pieces:
        assert grid.bucket(start) == grid.bucket(end)
