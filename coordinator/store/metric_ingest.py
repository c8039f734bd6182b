"""The telemetry store's ingest: a Ship's metric points, restart marks, hparams and delivery
progress, stored in one transaction.

Rules:
- A point is stored once: UNIQUE on (series, byte offset, index), which within a member is the
  dedup key (source identity, offset, index), and ``INSERT ... ON CONFLICT DO NOTHING``. A Ship
  is one transaction (points, series counters, delivery progress), committed before the reply.
- A Ship's per-point work (grouping by series, building rows) runs in a worker thread from the
  bounded pool (:func:`~tuneplane.coordinator.offload.in_thread`) before the
  transaction opens, and the series id is joined to each row in the database's own thread: a
  5,000-point batch is not walked on the event loop.
- A restarted TensorBoard writer's orphaned points are kept and marked (``orphaned = 1``), never
  deleted: a restart mark marks the points already stored, and a point stored after its mark
  is marked as it is inserted (:mod:`~tuneplane.coordinator.orphans` decides, by place, not by
  arrival). Series counters count only the others.
- hparams keep the first value of each name per source in reading order (byte offset), as
  TensorBoard keeps a tag's first metadata, whatever order the batches arrived in.
- Every write that changes the visible points (a Ship's points, a restart mark's orphans)
  recomputes the rollups it touches (:mod:`~tuneplane.coordinator.store.rollups`) in its own
  transaction.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import attrs

from tuneplane.agent.crashpoint import crashpoint

from ..offload import in_thread
from ..orphans import Restart, SeriesRule, is_event_file, place
from ..rollup_blocks import step_ranges
from ..store_location import Where
from ..values.jobs import MemberKey
from ..values.telemetry import (
    CollectorReport,
    ShippedHParams,
    ShippedPoint,
    ShippedRestart,
    ShipResult,
)
from . import rollups as store_rollups
from .db import Backend, StoreDb
from .handle import Handle


def _nan_to_null(value: float) -> float | None:
    # -0.0 is stored as 0.0 on every backend, as SQLite stores it: which signed zero a min or
    # max keeps would otherwise depend on reading order, and rollups would differ from points.
    return None if math.isnan(value) else value + 0.0


# A Ship batch of more than this many points is grouped into rows in a worker thread.
INLINE_POINTS = 50
# (source offset, value index, step, wall time, value): a metric_points row less its series id.
PointRow = tuple[int, int, int, float | None, float | None]


@attrs.frozen
class SeriesRows:
    """One series' share of a Ship batch: its rows in batch order, its newest wall time and
    the step ranges whose rollups its points may change."""

    source: str
    tag: str
    rows: list[PointRow]
    newest_wall: float | None
    steps: list[tuple[int, int]]


def series_rows(points: Sequence[ShippedPoint]) -> list[SeriesRows]:
    """``points`` grouped by (source, tag) in order of first appearance, as rows to insert."""
    rows: dict[tuple[str, str], list[PointRow]] = {}
    newest: dict[tuple[str, str], float] = {}
    for p in points:
        key = (p.source_id, p.tag)
        rows.setdefault(key, []).append(
            (p.offset, p.index, p.step, p.wall_time, _nan_to_null(p.value))
        )
        if p.wall_time is not None and (key not in newest or p.wall_time > newest[key]):
            newest[key] = p.wall_time
    return [
        SeriesRows(s, t, group, newest.get((s, t)), step_ranges(r[2] for r in group))
        for (s, t), group in rows.items()
    ]


class MetricIngest(StoreDb):
    """Ship batches into :class:`~tuneplane.coordinator.store.telemetry.TelemetryStore`."""

    def __init__(self, backend: Backend, where: Where) -> None:
        super().__init__(backend, where)
        # Series ids never change once made, so the mapping is safe to keep for the process.
        self._series_ids: dict[tuple[str, int, int, str, str], int] = {}

    async def _series_id(self, db: Handle, member: MemberKey, source: str, tag: str) -> int:
        key = (member.run_id, member.attempt, member.member_index, source, tag)
        found = self._series_ids.get(key)
        if found is not None:
            return found
        await db.execute(
            "INSERT INTO metric_series (run_id, attempt, member_index, source, tag) "
            "VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            key,
        )
        rows = list(
            await db.execute_fetchall(
                "SELECT id FROM metric_series WHERE run_id = ? AND attempt = ? "
                "AND member_index = ? AND source = ? AND tag = ?",
                key,
            )
        )
        series_id = int(rows[0][0])
        self._series_ids[key] = series_id
        return series_id

    async def ship(
        self,
        member: MemberKey,
        points: Sequence[ShippedPoint],
        report: CollectorReport,
        now: int,
        restarts: Sequence[ShippedRestart] = (),
        hparams: Sequence[ShippedHParams] = (),
    ) -> ShipResult:
        """Store ``points`` (each at most once, ever), restart marks, hparams and the
        collector's progress, durably, in one transaction."""
        if len(points) > INLINE_POINTS:
            batches = await in_thread(series_rows, points)
        else:
            batches = series_rows(points)

        async def work() -> ShipResult:
            try:
                async with self.transaction() as db:
                    await self._store_restarts(db, member, restarts)
                    await self._store_hparams(db, member, hparams)
                    return await self._ship(db, member, batches, len(points), report, now)
            except BaseException:
                # A rolled-back transaction may have made series rows that no longer exist.
                self._series_ids.clear()
                raise

        return await self.shielded(work)

    async def _ship(
        self,
        db: Handle,
        member: MemberKey,
        batches: list[SeriesRows],
        shipped: int,
        report: CollectorReport,
        now: int,
    ) -> ShipResult:
        stored = 0
        newest_wall: float | None = None
        changed: list[tuple[int, int, int]] = []
        known = await self._restarts(db, member) if batches else []
        for batch in batches:
            series_id = await self._series_id(db, member, batch.source, batch.tag)
            rule = SeriesRule.build(batch.source, batch.tag, known) if known else None
            visible = batch.rows
            orphans: list[PointRow] = []
            if rule is not None and not rule.empty:
                # Stored after the restart that orphans them: marked as they go in.
                visible = [r for r in batch.rows if not rule.orphaned(r[0], r[2])]
                orphans = [r for r in batch.rows if rule.orphaned(r[0], r[2])]
            # A generator: sqlite3 reads it in the connection's thread, off the event loop.
            cursor = await db.executemany(
                "INSERT INTO metric_points (series_id, source_offset, value_index, step, "
                "wall_time, value) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                ((series_id, *row) for row in visible),
            )
            added = max(int(cursor.rowcount), 0)
            crashpoint("mid-telemetry-ingest")
            hidden = 0
            if orphans:
                cursor = await db.executemany(
                    "INSERT INTO metric_points (series_id, source_offset, value_index, step, "
                    "wall_time, value, orphaned) VALUES (?, ?, ?, ?, ?, ?, 1) "
                    "ON CONFLICT DO NOTHING",
                    ((series_id, *row) for row in orphans),
                )
                hidden = max(int(cursor.rowcount), 0)
            if not added and not hidden:
                continue
            if added:
                # Recomputed over every step the batch holds: which rows were new is unknown.
                changed += [(series_id, lo, hi) for lo, hi in batch.steps]
            stored += added + hidden
            await _count(db, series_id, added, hidden)
            if batch.newest_wall is not None:
                newest = batch.newest_wall
                newest_wall = newest if newest_wall is None else max(newest_wall, newest)
        await store_rollups.refresh(db, changed, hidden=False)
        wall_ms = None if newest_wall is None else int(newest_wall * 1000)
        await db.execute(
            "INSERT INTO telemetry_delivery (run_id, attempt, member_index, points_stored, "
            "spool_points, backpressure, member_exited, drained, last_point_wall_ms, "
            "last_contact_ms, warnings, data_loss_warnings) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (run_id, attempt, member_index) DO UPDATE SET "
            "points_stored = telemetry_delivery.points_stored + excluded.points_stored, "
            "spool_points = excluded.spool_points, backpressure = excluded.backpressure, "
            "member_exited = MAX(telemetry_delivery.member_exited, excluded.member_exited), "
            "drained = MAX(telemetry_delivery.drained, excluded.drained), "
            "last_point_wall_ms = CASE WHEN excluded.last_point_wall_ms IS NULL "
            "OR telemetry_delivery.last_point_wall_ms > excluded.last_point_wall_ms "
            "THEN telemetry_delivery.last_point_wall_ms ELSE excluded.last_point_wall_ms END, "
            "last_contact_ms = excluded.last_contact_ms, warnings = excluded.warnings, "
            "data_loss_warnings = excluded.data_loss_warnings",
            (
                member.run_id,
                member.attempt,
                member.member_index,
                stored,
                report.spool_points,
                int(report.backpressure),
                int(report.member_exited),
                int(report.drained),
                wall_ms,
                now,
                report.warnings,
                report.data_loss_warnings,
            ),
        )
        return ShipResult(stored, shipped - stored)

    async def _restarts(self, db: Handle, member: MemberKey) -> list[Restart]:
        rows = await db.execute_fetchall(
            "SELECT source, source_offset, step, tags FROM metric_restarts "
            "WHERE run_id = ? AND attempt = ? AND member_index = ?",
            (member.run_id, member.attempt, member.member_index),
        )
        return [
            Restart(
                str(r[0]),
                int(r[1]),
                int(r[2]),
                None if r[3] is None else frozenset(json.loads(r[3])),
            )
            for r in rows
        ]

    async def _store_restarts(
        self, db: Handle, member: MemberKey, restarts: Sequence[ShippedRestart]
    ) -> None:
        """Store new restart marks, mark the points they orphan and count them out."""
        if not restarts:
            return
        key = (member.run_id, member.attempt, member.member_index)
        fresh: list[Restart] = []
        for r in restarts:
            cursor = await db.execute(
                "INSERT INTO metric_restarts (run_id, attempt, member_index, source, "
                "source_offset, step, tags, wall_time) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT DO NOTHING",
                (
                    *key,
                    r.source_id,
                    r.offset,
                    r.step,
                    None if r.tags is None else json.dumps(sorted(set(r.tags))),
                    r.wall_time,
                ),
            )
            if cursor.rowcount > 0:
                fresh.append(
                    Restart(
                        r.source_id, r.offset, r.step, None if r.tags is None else frozenset(r.tags)
                    )
                )
        if not fresh:
            return
        series = await db.execute_fetchall(
            "SELECT id, source, tag FROM metric_series "
            "WHERE run_id = ? AND attempt = ? AND member_index = ?",
            key,
        )
        changed: list[tuple[int, int, int]] = []
        for row in series:
            series_id, source, tag = int(row[0]), str(row[1]), str(row[2])
            if not is_event_file(source):
                continue
            scope, file_key = place(source)
            for mark in fresh:
                if mark.scope != scope or mark.file_key < file_key:
                    continue
                if mark.tags is not None and tag not in mark.tags:
                    continue
                # The highest visible step bounds the steps this mark can hide.
                ((top,),) = await db.execute_fetchall(
                    "SELECT MAX(step) FROM metric_points WHERE series_id = ? AND orphaned = 0",
                    (series_id,),
                )
                if top is None or int(top) < mark.step:
                    continue
                if mark.file_key == file_key:
                    cursor = await db.execute(
                        "UPDATE metric_points SET orphaned = 1 WHERE series_id = ? "
                        "AND step >= ? AND source_offset < ? AND orphaned = 0",
                        (series_id, mark.step, mark.offset),
                    )
                else:
                    cursor = await db.execute(
                        "UPDATE metric_points SET orphaned = 1 WHERE series_id = ? "
                        "AND step >= ? AND orphaned = 0",
                        (series_id, mark.step),
                    )
                if cursor.rowcount > 0:
                    await _count(db, series_id, -int(cursor.rowcount), int(cursor.rowcount))
                    changed.append((series_id, mark.step, int(top)))
        await store_rollups.refresh(db, changed, hidden=True)

    async def _store_hparams(
        self, db: Handle, member: MemberKey, hparams: Sequence[ShippedHParams]
    ) -> None:
        key = (member.run_id, member.attempt, member.member_index)
        for h in hparams:
            # The earliest record of a name (by offset, then index) wins, whatever arrived first.
            await db.executemany(
                "INSERT INTO run_hparams (run_id, attempt, member_index, source, name, "
                "value_json, source_offset, value_index) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (run_id, attempt, member_index, source, name) DO UPDATE SET "
                "value_json = excluded.value_json, source_offset = excluded.source_offset, "
                "value_index = excluded.value_index WHERE (excluded.source_offset, "
                "excluded.value_index) < (run_hparams.source_offset, run_hparams.value_index)",
                [(*key, h.source_id, n, v, h.offset, h.index) for n, v in h.hparams],
            )
            await db.executemany(
                "INSERT INTO run_hparam_metrics (run_id, attempt, member_index, source, metric) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                [(*key, h.source_id, m) for m in h.metrics],
            )


async def _count(db: Handle, series_id: int, visible: int, orphaned: int) -> None:
    """Move a series' counters by ``visible`` and ``orphaned`` points and read its newest
    visible point again (one probe of the visible-points index)."""
    await db.execute(
        "UPDATE metric_series SET points = points + ?, orphaned = orphaned + ?, "
        "(last_step, last_value, last_wall_time) = (SELECT step, value, wall_time "
        "FROM metric_points WHERE series_id = ? AND orphaned = 0 "
        "ORDER BY step DESC, id DESC LIMIT 1) WHERE id = ?",
        (visible, orphaned, series_id, series_id),
    )
