"""The telemetry store's reads: hparams, delivery progress, tag lists and bounded series.

Rules:
- Every read skips a restarted TensorBoard writer's orphaned points (``orphaned = 1``).
- The heavy read (:meth:`SeriesReads.query_series`) runs in a worker thread on its own
  read-only connection, in one read transaction, so a million-point series never stalls the
  gateways.
- A bucketed read comes from rollups (:mod:`~tuneplane.coordinator.store.rollups`): per-block
  summaries that every write changing the visible points recomputes in its own transaction, so
  the buckets are exactly those the raw points give (:func:`raw_buckets`, kept as the
  reference) while reading thousands of rows, not millions.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from ..downsample import Bucket, Row, downsample, every_point
from ..values.jobs import MemberKey
from ..values.metrics import (
    Delivery,
    MetricSelector,
    RunHParams,
    SeriesResult,
    TagSummary,
)
from . import rollups as store_rollups
from .core import NotFound
from .db import StoreDb
from .handle import SnapshotReader


def _null_to_nan(value: Any) -> float:
    return math.nan if value is None else float(value)


class SeriesReads(StoreDb):
    """Reads of :class:`~tuneplane.coordinator.store.telemetry.TelemetryStore`'s points."""

    async def hparams(self, run_id: str) -> dict[tuple[int, int], list[RunHParams]]:
        """Each member's (attempt, member index) recorded hparams, by source."""
        values = await self.reader.execute_fetchall(
            "SELECT attempt, member_index, source, name, value_json FROM run_hparams "
            "WHERE run_id = ? ORDER BY attempt, member_index, source, source_offset, "
            "value_index, name",
            (run_id,),
        )
        metrics = await self.reader.execute_fetchall(
            "SELECT attempt, member_index, source, metric FROM run_hparam_metrics "
            "WHERE run_id = ? ORDER BY attempt, member_index, source, metric",
            (run_id,),
        )
        found: dict[tuple[int, int, str], tuple[list[tuple[str, str]], list[str]]] = {}
        for r in values:
            found.setdefault((int(r[0]), int(r[1]), str(r[2])), ([], []))[0].append(
                (str(r[3]), str(r[4]))
            )
        for r in metrics:
            found.setdefault((int(r[0]), int(r[1]), str(r[2])), ([], []))[1].append(str(r[3]))
        out: dict[tuple[int, int], list[RunHParams]] = {}
        for (attempt, index, source), (names, tags) in sorted(found.items()):
            out.setdefault((attempt, index), []).append(
                RunHParams(source, tuple(names), tuple(tags))
            )
        return out

    async def delivery(self, run_id: str) -> list[Delivery]:
        hparams = await self.hparams(run_id)
        orphaned = {
            (int(r[0]), int(r[1])): int(r[2])
            for r in await self.reader.execute_fetchall(
                "SELECT attempt, member_index, SUM(orphaned) FROM metric_series "
                "WHERE run_id = ? GROUP BY attempt, member_index",
                (run_id,),
            )
        }
        rows = await self.reader.execute_fetchall(
            "SELECT attempt, member_index, points_stored, spool_points, backpressure, drained, "
            "last_point_wall_ms, last_contact_ms, warnings, data_loss_warnings "
            "FROM telemetry_delivery WHERE run_id = ? ORDER BY attempt, member_index",
            (run_id,),
        )
        return [
            Delivery(
                member=MemberKey(run_id, int(r[0]), int(r[1])),
                points_stored=int(r[2]),
                spool_points=int(r[3]),
                backpressure=bool(r[4]),
                drained=bool(r[5]),
                last_point_wall_ms=None if r[6] is None else int(r[6]),
                last_contact_ms=int(r[7]),
                warnings=int(r[8]),
                data_loss_warnings=int(r[9]),
                hparams=tuple(hparams.get((int(r[0]), int(r[1])), ())),
                orphaned_points=orphaned.get((int(r[0]), int(r[1])), 0),
            )
            for r in rows
        ]

    async def _attempt(self, selector: MetricSelector) -> int:
        if selector.attempt:
            return selector.attempt
        rows = list(
            await self.reader.execute_fetchall(
                "SELECT COALESCE(MAX(attempt), 0) FROM metric_series WHERE run_id = ?",
                (selector.run_id,),
            )
        )
        return int(rows[0][0])

    def _where(self, selector: MetricSelector, attempt: int) -> tuple[str, list[Any]]:
        clauses = ["run_id = ?", "attempt = ?"]
        args: list[Any] = [selector.run_id, attempt]
        if selector.member_index is not None:
            clauses.append("member_index = ?")
            args.append(selector.member_index)
        if selector.source:
            clauses.append("source = ?")
            args.append(selector.source)
        return " AND ".join(clauses), args

    async def list_tags(self, selector: MetricSelector) -> tuple[int, list[TagSummary]]:
        """The attempt read and its tags (canonical) or series (raw), ordered by tag."""
        attempt = await self._attempt(selector)
        where, args = self._where(selector, attempt)
        rows = await self.reader.execute_fetchall(
            "SELECT tag, member_index, source, points, last_step, last_value, last_wall_time "
            f"FROM metric_series WHERE {where} AND points > 0 "
            "ORDER BY tag, member_index, source",
            args,
        )
        if selector.raw:
            return attempt, [
                TagSummary(
                    str(r[0]),
                    attempt,
                    int(r[1]),
                    str(r[2]),
                    int(r[3]),
                    int(r[4]),
                    _null_to_nan(r[5]),
                    None if r[6] is None else float(r[6]),
                    1,
                )
                for r in rows
            ]
        merged: dict[str, TagSummary] = {}
        for r in rows:
            tag, points, last_step = str(r[0]), int(r[3]), int(r[4])
            seen = merged.get(tag)
            summary = TagSummary(
                tag,
                attempt,
                None,
                "",
                points,
                last_step,
                _null_to_nan(r[5]),
                None if r[6] is None else float(r[6]),
                1,
            )
            if seen is not None:
                newer = summary if last_step > seen.last_step else seen
                summary = TagSummary(
                    tag,
                    attempt,
                    None,
                    "",
                    seen.points + points,
                    newer.last_step,
                    newer.last_value,
                    newer.last_wall_time,
                    seen.series + 1,
                )
            merged[tag] = summary
        return attempt, list(merged.values())

    async def query_series(
        self,
        selector: MetricSelector,
        tag: str,
        max_points: int,
        steps: tuple[int, int] | None = None,
    ) -> SeriesResult:
        """A bounded series of ``tag``: whole when it has at most ``max_points`` points,
        otherwise at most ``max_points`` buckets (min, max and last each) over its steps.

        ``steps`` (first, last), inclusive: only the points in that range (a zoom), in at most
        ``max_points`` buckets over the part of it the series covers, read from rollups; then
        ``downsampled`` says whether any bucket holds more than one point."""
        attempt = await self._attempt(selector)
        where, args = self._where(selector, attempt)
        rows = list(
            await self.reader.execute_fetchall(
                f"SELECT id, points FROM metric_series WHERE {where} AND tag = ? AND points > 0",
                [*args, tag],
            )
        )
        if not rows:
            scope = "raw series" if selector.raw else "metric"
            raise NotFound(
                f"Job {selector.run_id} has no {scope} {tag!r} in attempt {attempt or '(none)'}"
                f"{self._narrowing(selector)}. List what it has with `tp metrics "
                f"{selector.run_id}`."
            )
        series_ids = [int(r[0]) for r in rows]
        total = sum(int(r[1]) for r in rows)
        if steps is not None:
            window = steps
            zoomed: list[Bucket] = await self.read_snapshot(
                lambda db: window_buckets(db, series_ids, *window, max_points)
            )
            return SeriesResult(
                tag,
                attempt,
                total,
                any(b.count > 1 for b in zoomed),
                tuple(zoomed),
                len(series_ids),
            )
        buckets = await self.read_snapshot(
            lambda db: _read_buckets(db, series_ids, total, max_points)
        )
        return SeriesResult(
            tag, attempt, total, total > max_points, tuple(buckets), len(series_ids)
        )

    @staticmethod
    def _narrowing(selector: MetricSelector) -> str:
        parts = []
        if selector.member_index is not None:
            parts.append(f"member {selector.member_index}")
        if selector.source:
            parts.append(f"source {selector.source!r}")
        return f" ({', '.join(parts)})" if parts else ""


def _rows(db: SnapshotReader, series_ids: list[int]) -> Iterator[Row]:
    marks = ",".join("?" for _ in series_ids)
    cursor = db.execute(
        f"SELECT step, id, value FROM metric_points WHERE series_id IN ({marks}) AND orphaned = 0",
        series_ids,
    )
    cursor.arraysize = 10_000
    while chunk := cursor.fetchmany():
        for step, arrival, value in chunk:
            yield step, arrival, math.nan if value is None else value


def _step_range(db: SnapshotReader, series_ids: list[int]) -> tuple[int, int] | None:
    """The lowest and highest visible step of ``series_ids``; None when they have no point."""
    lo: int | None = None
    hi: int | None = None
    for series_id in series_ids:
        # Per series, MIN and MAX are two index probes; over an IN list they would scan.
        (low,) = db.execute(
            "SELECT MIN(step) FROM metric_points WHERE series_id = ? AND orphaned = 0",
            (series_id,),
        ).fetchone()
        (high,) = db.execute(
            "SELECT MAX(step) FROM metric_points WHERE series_id = ? AND orphaned = 0",
            (series_id,),
        ).fetchone()
        if low is not None:
            lo = low if lo is None else min(lo, low)
            hi = high if hi is None else max(hi, high)
    return None if lo is None or hi is None else (lo, hi)


def raw_buckets(db: SnapshotReader, series_ids: list[int], max_points: int) -> list[Bucket]:
    """The buckets of ``series_ids`` computed from every raw point: the reference the rollups
    must equal, and the benchmark's baseline."""
    bounds = _step_range(db, series_ids)
    if bounds is None:
        return []
    return downsample(_rows(db, series_ids), *bounds, max_points)


def rollup_buckets(db: SnapshotReader, series_ids: list[int], max_points: int) -> list[Bucket]:
    """The same buckets as :func:`raw_buckets`, read from rollups."""
    bounds = _step_range(db, series_ids)
    if bounds is None:
        return []
    return store_rollups.read_buckets(
        lambda sql, args: db.execute(sql, args).fetchall(), series_ids, *bounds, max_points
    )


def window_buckets(
    db: SnapshotReader, series_ids: list[int], first: int, last: int, max_points: int
) -> list[Bucket]:
    """The buckets of the points of ``series_ids`` with steps in ``[first, last]``, over the
    part of that range the series cover (a zoom that reaches past their ends draws no empty
    space), from rollups; none when no point lies there."""
    bounds = _step_range(db, series_ids)
    if bounds is None:
        return []
    lo, hi = max(first, bounds[0]), min(last, bounds[1])
    if lo > hi:
        return []
    return store_rollups.read_buckets(
        lambda sql, args: db.execute(sql, args).fetchall(),
        series_ids,
        lo,
        hi,
        max_points,
        window=True,
    )


def _read_buckets(
    db: SnapshotReader, series_ids: list[int], total: int, max_points: int
) -> list[Any]:
    """Runs in a worker thread, on a connection of its own, in one read transaction (one
    snapshot: the step range, the rollups and the points it reads all agree)."""
    if total <= max_points:
        return every_point(_rows(db, series_ids))
    return rollup_buckets(db, series_ids, max_points)
