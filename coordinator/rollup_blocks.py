"""Step blocks and the arithmetic of answering a bucketed series from them (metric rollups).

Theory of operation:
- A series' visible points are summarised per block of steps at :data:`LEVELS` levels: a level
  ``k`` block ``j`` holds the steps ``[j * w, (j + 1) * w - 1]`` with ``w = FANOUT ** k``
  (floor division, so negative steps have blocks too), and its summary is what a bucket needs
  that composes: point count, first and last step, min and max of the non-NaN values. A block's
  ``FANOUT`` children one level down partition it; level 1's children are the raw points.
- A bucketed read (:mod:`~tuneplane.coordinator.downsample` defines the buckets) reads every
  block of the lowest level that has at most ``FANOUT`` blocks per bucket over ``[lo, hi]``,
  but those that hold a bucket edge; in their place it reads their children that hold none,
  level by level, and at level 1 the points of the blocks that still hold an edge
  (:func:`plan`: the same blocks for every series, each wholly inside one bucket, covering every
  step once). A bucket's last value is then read as the point at its last step with the
  highest arrival, as the raw computation picks it.
- After a write, the blocks over the written steps are recomputed from the level below, so the
  summaries always equal what the visible points give (:func:`refresh_runs` says which).
- Pure: the store feeds rows; nothing here reads a database.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import attrs

from .downsample import INF, Bucket, DownsampleError

#: Children per block; a level-``k`` block is ``FANOUT ** k`` steps wide.
FANOUT = 4
#: Levels 1..LEVELS: blocks of 4 up to 4**10 (1,048,576) steps.
LEVELS = 10

#: A block's summary as read: (points, first step, last step, min, max); min and max are None
#: when every value in the block is NaN.
BlockRow = tuple[int, int, int, float | None, float | None]
#: A run of consecutive blocks at one level: (level, first block, last block).
BlockRun = tuple[int, int, int]


def width(level: int) -> int:
    """How many steps a block of ``level`` spans (level 0: one step, a raw point)."""
    steps: int = FANOUT**level
    return steps


def block_of(step: int, level: int) -> int:
    return step // width(level)


def refresh_runs(ranges: Iterable[tuple[int, int]]) -> list[BlockRun]:
    """The runs of blocks, level by level from 1 up, that hold any step of the inclusive step
    ``ranges``: what to recompute, in that order, after points in them changed."""
    # Level 0 is the steps themselves; each level's runs are its children's runs, divided.
    runs = sorted((lo, hi) for lo, hi in ranges if lo <= hi)
    out: list[BlockRun] = []
    for level in range(1, LEVELS + 1):
        mapped: list[tuple[int, int]] = []
        for lo, hi in runs:
            a, b = lo // FANOUT, hi // FANOUT
            if mapped and a <= mapped[-1][1] + 1:
                mapped[-1] = (mapped[-1][0], max(mapped[-1][1], b))
            else:
                mapped.append((a, b))
        out.extend((level, a, b) for a, b in mapped)
        runs = mapped
    return out


def step_ranges(steps: Iterable[int]) -> list[tuple[int, int]]:
    """``steps`` as inclusive ranges, one per run of consecutive level-1 blocks that hold them."""
    out: list[tuple[int, int]] = []
    for step in sorted(set(steps)):
        if out and step // FANOUT <= out[-1][1] // FANOUT + 1:
            out[-1] = (out[-1][0], step)
        else:
            out.append((step, step))
    return out


@attrs.frozen
class Grid:
    """The buckets of one read: ``n`` equal step intervals over ``[lo, hi]``."""

    lo: int
    hi: int
    n: int

    @classmethod
    def over(cls, lo: int, hi: int, max_buckets: int) -> Grid:
        if max_buckets < 1:
            raise DownsampleError(f"max_buckets is {max_buckets}; ask for at least one bucket")
        if hi < lo:
            raise DownsampleError(f"the step range [{lo}, {hi}] is empty; lo must not exceed hi")
        return cls(lo, hi, min(max_buckets, hi - lo + 1))

    @property
    def span(self) -> int:
        return self.hi - self.lo + 1

    def bucket(self, step: int) -> int:
        return (step - self.lo) * self.n // self.span

    def edges(self) -> list[int]:
        """The first step of every bucket but the first, ascending."""
        lo, n, span = self.lo, self.n, self.span
        return [lo + (b * span + n - 1) // n for b in range(1, n)]

    def top_level(self) -> int:
        """The lowest level with at most ``FANOUT`` blocks per bucket over the range (the
        highest level when none has so few)."""
        for level in range(1, LEVELS + 1):
            if block_of(self.hi, level) - block_of(self.lo, level) + 1 <= FANOUT * self.n:
                return level
        return LEVELS


@attrs.frozen
class Plan:
    """What a bucketed read reads: each block wholly inside one bucket whose parent is not,
    and the points of the level-1 blocks that hold a bucket edge. Every step of ``[lo, hi]``
    is covered once, so every point is counted once (blocks reach past ``lo`` and ``hi`` only
    where there are no points)."""

    #: The top level and its first and last block; all of them are read...
    top: tuple[int, int, int]
    #: ...but these, which hold a bucket edge.
    top_split: frozenset[int]
    #: (level, blocks) from the level below the top down to 1: the blocks to read.
    levels: tuple[tuple[int, tuple[int, ...]], ...]
    #: The steps whose points are read one by one, ascending.
    steps: tuple[int, ...]


def plan(grid: Grid, window: bool = False) -> Plan:
    """The blocks and steps that answer ``grid`` (the same for every series).

    ``window``: the series may have points outside ``[lo, hi]`` (a zoomed read of part of it),
    so ``lo`` and ``hi + 1`` count as edges too: the blocks that straddle them are split like
    any other, and no block reaching past the range is read."""
    edges = grid.edges()
    if window:
        edges += [grid.lo, grid.hi + 1]
    top = grid.top_level()

    def split(level: int) -> set[int]:
        w = width(level)
        return {edge // w for edge in edges if edge % w}

    top_split = above = split(top)
    levels: list[tuple[int, tuple[int, ...]]] = []
    for level in range(top - 1, 0, -1):
        here = split(level)
        w = width(level)
        levels.append(
            (
                level,
                tuple(
                    c
                    for c in children(above)
                    if c not in here and c * w <= grid.hi and c * w + w - 1 >= grid.lo
                ),
            )
        )
        above = here
    w = width(1)
    steps = [
        s
        for block in sorted(above)
        for s in range(max(block * w, grid.lo), min(block * w + w - 1, grid.hi) + 1)
    ]
    return Plan(
        (top, block_of(grid.lo, top), block_of(grid.hi, top)),
        frozenset(top_split),
        tuple(levels),
        tuple(steps),
    )


def children(blocks: Iterable[int]) -> list[int]:
    """The blocks one level down that partition ``blocks``, ascending."""
    return [c for b in sorted(set(blocks)) for c in range(b * FANOUT, b * FANOUT + FANOUT)]


class Fold:
    """Buckets built from whole blocks and single points; the same rules as
    :func:`~tuneplane.coordinator.downsample.downsample`."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        n = grid.n
        self.counts = [0] * n
        self.firsts = [0] * n
        self.lasts = [0] * n
        self.mins = [INF] * n
        self.maxs = [-INF] * n

    def blocks(self, rows: Iterable[BlockRow]) -> None:
        """Fold summaries of blocks that each lie wholly inside one bucket."""
        lo, n, span = self.grid.lo, self.grid.n, self.grid.span
        counts, firsts, lasts = self.counts, self.firsts, self.lasts
        mins, maxs = self.mins, self.maxs
        for count, first, last, low, high in rows:
            b = (first - lo) * n // span
            if counts[b] == 0:
                firsts[b] = first
                lasts[b] = last
            else:
                if first < firsts[b]:
                    firsts[b] = first
                if last > lasts[b]:
                    lasts[b] = last
            counts[b] += count
            # None (every value NaN) never moves min or max, as NaN never does.
            if low is not None and low < mins[b]:
                mins[b] = low
            if high is not None and high > maxs[b]:
                maxs[b] = high

    def points(self, rows: Iterable[tuple[int, float | None]]) -> None:
        """Fold single points ``(step, value)``."""
        self.blocks((1, step, step, value, value) for step, value in rows)

    def last_steps(self) -> list[int]:
        """Each non-empty bucket's last step, in bucket order."""
        return [self.lasts[b] for b in range(self.grid.n) if self.counts[b]]

    def buckets(self, last_values: Sequence[float]) -> list[Bucket]:
        """The non-empty buckets, given each one's last value in the order of
        :meth:`last_steps`."""
        out: list[Bucket] = []
        filled = (b for b in range(self.grid.n) if self.counts[b])
        for b, last in zip(filled, last_values, strict=True):
            low, high = self.mins[b], self.maxs[b]
            if low > high:  # only NaN landed here
                low = high = math.nan
            out.append(Bucket(self.firsts[b], self.lasts[b], self.counts[b], low, high, last))
        return out
