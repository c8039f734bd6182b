"""The telemetry store: collector credentials, metric points and delivery progress.

Rules:
- Its own SQLite file (``telemetry.db``, WAL, ``synchronous=FULL``) or PostgreSQL schema
  (``tuneplane_telemetry``), with its own writer, apart from the coordinator store: metrics
  never decide a Job's state, and a Job's state never waits behind a batch of points. Its
  schema has its own numbered migrations (``telemetry_schema_version``).
- A point is stored once: UNIQUE on (series, byte offset, index), which within a member is the
  dedup key (source identity, offset, index), and ``INSERT ... ON CONFLICT DO NOTHING``. A Ship
  is one transaction (points, series counters, delivery progress), committed before the reply.
- A Ship's per-point work (grouping by series, building rows) runs in a worker thread from the
  bounded pool (:func:`~tuneplane.coordinator.gateways.message_limits.in_thread`) before the
  transaction opens, and the series id is joined to each row in the database's own thread: a
  5,000-point batch is not walked on the event loop.
- A restarted TensorBoard writer's orphaned points are kept and marked (``orphaned = 1``), never
  deleted: a restart mark marks the points already stored, and a point stored after its mark
  is marked as it is inserted (:mod:`~tuneplane.coordinator.orphans` decides, by place, not by
  arrival). Every read skips them; series counters count only the others.
- hparams keep the first value of each name per source in reading order (byte offset), as
  TensorBoard keeps a tag's first metadata, whatever order the batches arrived in.
- Writes run shielded (a caller's deadline never leaves half a transaction); the heavy read
  (:meth:`TelemetryStore.query_series`) runs in a worker thread on its own read-only connection,
  in one read transaction, so a million-point series never stalls the gateways.
- A bucketed read comes from rollups (:mod:`~tuneplane.coordinator.store.rollups`): per-block
  summaries that every write changing the visible points (a Ship's points, a restart mark's
  orphans) recomputes in its own transaction, so the buckets are exactly those the raw points
  give (:func:`raw_buckets`, kept as the reference) while reading thousands of rows, not millions.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs

from tuneplane.agent.crashpoint import crashpoint

from ..downsample import Bucket, Row, downsample, every_point
from ..gateways.message_limits import in_thread
from ..orphans import Restart, SeriesRule, is_event_file, place
from ..rollup_blocks import step_ranges
from ..values.jobs import MemberKey
from ..values.metrics import (
    Delivery,
    MetricSelector,
    RunHParams,
    SeriesResult,
    TagSummary,
)
from ..values.telemetry import (
    CollectorGrant,
    CollectorReport,
    ShippedHParams,
    ShippedPoint,
    ShippedRestart,
    ShipResult,
)
from . import rollups as store_rollups
from .core import NotFound
from .db import Backend, StoreDb
from .handle import Handle, SnapshotReader
from .location import Where

log = logging.getLogger(__name__)

DB_NAME = "telemetry.db"
T = TypeVar("T")

MIGRATIONS: tuple[tuple[int, tuple[str, ...]], ...] = (
    (
        1,
        (
            """CREATE TABLE collector_credentials (
                token_hash TEXT PRIMARY KEY,
                run_id TEXT NOT NULL,
                attempt INTEGER NOT NULL,
                member_index INTEGER NOT NULL,
                node_id TEXT NOT NULL,
                issued_at_ms BIGINT NOT NULL,
                expires_at_ms BIGINT NOT NULL,
                ended_at_ms BIGINT
            )""",
            "CREATE INDEX collector_credentials_by_node ON collector_credentials (node_id)",
            "CREATE INDEX collector_credentials_by_member ON collector_credentials "
            "(run_id, attempt, member_index)",
            """CREATE TABLE metric_series (
                id INTEGER PRIMARY KEY,
                run_id TEXT NOT NULL,
                attempt INTEGER NOT NULL,
                member_index INTEGER NOT NULL,
                source TEXT NOT NULL,
                tag TEXT NOT NULL,
                points BIGINT NOT NULL DEFAULT 0,
                last_step BIGINT,
                last_value DOUBLE PRECISION,
                last_wall_time DOUBLE PRECISION,
                UNIQUE (run_id, attempt, member_index, source, tag)
            )""",
            """CREATE TABLE metric_points (
                id INTEGER PRIMARY KEY,
                series_id INTEGER NOT NULL REFERENCES metric_series(id),
                source_offset BIGINT NOT NULL,
                value_index INTEGER NOT NULL,
                step BIGINT NOT NULL,
                wall_time DOUBLE PRECISION,
                value DOUBLE PRECISION,
                UNIQUE (series_id, source_offset, value_index)
            )""",
            "CREATE INDEX metric_points_by_step ON metric_points (series_id, step)",
            """CREATE TABLE telemetry_delivery (
                run_id TEXT NOT NULL,
                attempt INTEGER NOT NULL,
                member_index INTEGER NOT NULL,
                points_stored BIGINT NOT NULL DEFAULT 0,
                spool_points BIGINT NOT NULL DEFAULT 0,
                backpressure INTEGER NOT NULL DEFAULT 0,
                member_exited INTEGER NOT NULL DEFAULT 0,
                drained INTEGER NOT NULL DEFAULT 0,
                last_point_wall_ms BIGINT,
                last_contact_ms BIGINT NOT NULL,
                warnings BIGINT NOT NULL DEFAULT 0,
                data_loss_warnings BIGINT NOT NULL DEFAULT 0,
                PRIMARY KEY (run_id, attempt, member_index)
            )""",
        ),
    ),
    (
        2,
        (
            # Orphaned by a restarted TensorBoard writer: kept, never read (docs/telemetry.md).
            "ALTER TABLE metric_points ADD COLUMN orphaned INTEGER NOT NULL DEFAULT 0",
            "ALTER TABLE metric_series ADD COLUMN orphaned BIGINT NOT NULL DEFAULT 0",
            # Every read, the newest visible point and a restart's sweep look only at visible
            # points: an index of those alone keeps them from walking an orphaned stretch.
            "DROP INDEX metric_points_by_step",
            "CREATE INDEX metric_points_visible ON metric_points (series_id, step) "
            "WHERE orphaned = 0",
            """CREATE TABLE metric_restarts (
                run_id TEXT NOT NULL,
                attempt INTEGER NOT NULL,
                member_index INTEGER NOT NULL,
                source TEXT NOT NULL,
                source_offset BIGINT NOT NULL,
                step BIGINT NOT NULL,
                tags TEXT,
                wall_time DOUBLE PRECISION,
                UNIQUE (run_id, attempt, member_index, source, source_offset)
            )""",
            """CREATE TABLE run_hparams (
                run_id TEXT NOT NULL,
                attempt INTEGER NOT NULL,
                member_index INTEGER NOT NULL,
                source TEXT NOT NULL,
                name TEXT NOT NULL,
                value_json TEXT NOT NULL,
                source_offset BIGINT NOT NULL,
                value_index INTEGER NOT NULL,
                PRIMARY KEY (run_id, attempt, member_index, source, name)
            )""",
            """CREATE TABLE run_hparam_metrics (
                run_id TEXT NOT NULL,
                attempt INTEGER NOT NULL,
                member_index INTEGER NOT NULL,
                source TEXT NOT NULL,
                metric TEXT NOT NULL,
                PRIMARY KEY (run_id, attempt, member_index, source, metric)
            )""",
        ),
    ),
    # Rollups for bucketed reads, built from the points already stored (docs/telemetry.md).
    (3, store_rollups.migration()),
)


def telemetry_db_path(state_dir: Path) -> Path:
    return state_dir / DB_NAME


def _nan_to_null(value: float) -> float | None:
    # -0.0 is stored as 0.0 on every backend, as SQLite stores it: which signed zero a min or
    # max keeps would otherwise depend on reading order, and rollups would differ from points.
    return None if math.isnan(value) else value + 0.0


def _null_to_nan(value: Any) -> float:
    return math.nan if value is None else float(value)


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


class TelemetryStore(StoreDb):
    """Open with :meth:`open`; close with :meth:`close`."""

    LABEL = "telemetry store"
    VERSION_TABLE = "telemetry_schema_version"
    SCHEMA = "tuneplane_telemetry"
    MIGRATIONS = MIGRATIONS

    def __init__(self, backend: Backend, where: Where) -> None:
        super().__init__(backend, where)
        # Series ids never change once made, so the mapping is safe to keep for the process.
        self._series_ids: dict[tuple[str, int, int, str, str], int] = {}

    # ----- collector credentials ---------------------------------------------------------------

    async def issue_credentials(
        self, grants: Sequence[tuple[str, MemberKey, str]], now: int, ttl_ms: int
    ) -> None:
        """Record ``(token hash, member, node id)`` grants, valid until ``now + ttl_ms``."""

        async def work() -> None:
            async with self.transaction() as db:
                await db.executemany(
                    "INSERT INTO collector_credentials (token_hash, run_id, attempt, "
                    "member_index, node_id, issued_at_ms, expires_at_ms) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    [
                        (h, k.run_id, k.attempt, k.member_index, node, now, now + ttl_ms)
                        for h, k, node in grants
                    ],
                )

        await self.shielded(work)

    async def grant_for(self, token_hash: str) -> CollectorGrant | None:
        rows = list(
            await self.reader.execute_fetchall(
                "SELECT run_id, attempt, member_index, node_id, issued_at_ms, expires_at_ms, "
                "ended_at_ms FROM collector_credentials WHERE token_hash = ?",
                (token_hash,),
            )
        )
        if not rows:
            return None
        r = rows[0]
        return CollectorGrant(
            MemberKey(str(r[0]), int(r[1]), int(r[2])),
            str(r[3]),
            int(r[4]),
            int(r[5]),
            None if r[6] is None else int(r[6]),
        )

    async def refresh_credentials(
        self, beats: Mapping[str, int], ttl_ms: int, slack_ms: int
    ) -> int:
        """For each Node's heartbeat time ``at`` in ``beats`` (node id -> ms), extend the
        credentials of its members that have not ended to ``at + ttl``, in one transaction.

        Only rows within ``ttl - slack`` of expiring are written, so a heartbeat usually
        writes nothing. Returns how many were extended.
        """

        async def work() -> int:
            async with self.transaction() as db:
                # executemany: one trip to the database thread; rowcount sums the rows.
                cursor = await db.executemany(
                    "UPDATE collector_credentials SET expires_at_ms = ? WHERE node_id = ? "
                    "AND ended_at_ms IS NULL AND expires_at_ms < ?",
                    [
                        (at + ttl_ms, node_id, at + ttl_ms - slack_ms)
                        for node_id, at in sorted(beats.items())
                    ],
                )
                return int(cursor.rowcount)

        return await self.shielded(work)

    async def member_ended(self, member: MemberKey, now: int, drain_ms: int) -> None:
        """The member reached a terminal state: its credentials last ``drain_ms`` more, once."""

        async def work() -> None:
            async with self.transaction() as db:
                await db.execute(
                    "UPDATE collector_credentials SET ended_at_ms = ?, expires_at_ms = ? "
                    "WHERE run_id = ? AND attempt = ? AND member_index = ? "
                    "AND ended_at_ms IS NULL",
                    (now, now + drain_ms, member.run_id, member.attempt, member.member_index),
                )

        await self.shielded(work)

    # ----- shipping ----------------------------------------------------------------------------

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

    # ----- reads -------------------------------------------------------------------------------

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
        self, selector: MetricSelector, tag: str, max_points: int
    ) -> SeriesResult:
        """A bounded series of ``tag``: whole when it has at most ``max_points`` points,
        otherwise at most ``max_points`` buckets (min, max and last each) over its steps."""
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
        buckets = await self._read_snapshot(
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


def _read_buckets(
    db: SnapshotReader, series_ids: list[int], total: int, max_points: int
) -> list[Any]:
    """Runs in a worker thread, on a connection of its own, in one read transaction (one
    snapshot: the step range, the rollups and the points it reads all agree)."""
    if total <= max_points:
        return every_point(_rows(db, series_ids))
    return rollup_buckets(db, series_ids, max_points)
