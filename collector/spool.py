"""The collector's spool: points made durable on the Node before the read position advances.

Rules:
- One SQLite file on private host-local storage, WAL, ``synchronous=FULL``: a returned
  :meth:`Spool.append` is on disk. Points are UNIQUE on their dedup key and appended with
  ``ON CONFLICT DO NOTHING``, so bytes re-read after a crash never sit in the spool twice.
- Points leave the spool only through :meth:`Spool.acknowledge`, after the gateway stored them
  or refused them for good (then recorded as data-loss warnings in the same transaction).
  Ids grow (AUTOINCREMENT), so acknowledging "up to id N" never touches a later point.
- Bounded: :meth:`Spool.full` says when ``max_points`` are waiting. The caller then stops
  reading (backpressure); nothing is ever dropped to make room.
- Marks (restarts, hparams: :mod:`tuneplane.collector.points`) wait in their own table with the
  same dedup-key uniqueness and leave it with the points' acknowledgement, in one transaction.
- Blocking calls: the Trio shell runs them in a worker thread, one at a time.
"""

from __future__ import annotations

import json
import math
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from .point_rules import PointScreen, screen_marks, storable
from .points import HParamsMark, Mark, ReadWarning, RestartMark, ScalarPoint

SPOOL_FILE = "spool.db"
DEFAULT_MAX_POINTS = 1_000_000

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS points (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        source_id TEXT NOT NULL,
        byte_offset INTEGER NOT NULL,
        value_index INTEGER NOT NULL,
        tag TEXT NOT NULL,
        step INTEGER NOT NULL,
        wall_time REAL,
        value REAL,
        UNIQUE (source_id, byte_offset, value_index)
    )""",
    """CREATE TABLE IF NOT EXISTS warnings (
        source TEXT NOT NULL,
        byte_offset INTEGER NOT NULL,
        kind TEXT NOT NULL,
        data_loss INTEGER NOT NULL,
        message TEXT NOT NULL,
        UNIQUE (source, byte_offset, kind)
    )""",
    """CREATE TABLE IF NOT EXISTS marks (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        source_id TEXT NOT NULL,
        byte_offset INTEGER NOT NULL,
        value_index INTEGER NOT NULL,
        kind TEXT NOT NULL,
        body TEXT NOT NULL,
        UNIQUE (source_id, byte_offset, value_index, kind)
    )""",
)
RESTART = "restart"
HPARAMS = "hparams"


class SpoolError(Exception):
    """The spool file cannot be used; ``str()`` names it and says what to do."""


@attrs.frozen(slots=True)
class SpooledPoint:
    """A point waiting in the spool; ``id`` orders them and acknowledges them."""

    id: int
    source_id: str
    offset: int
    index: int
    tag: str
    step: int
    wall_time: float | None
    value: float


@attrs.frozen(slots=True)
class SpooledMark:
    """A mark waiting in the spool; ``id`` orders and acknowledges marks."""

    id: int
    mark: Mark


def _mark_row(m: Mark) -> tuple[str, int, int, str, str]:
    source_id = storable(m.source_id or m.source)
    if isinstance(m, RestartMark):
        restart: dict[str, Any] = {"step": m.step, "tags": m.tags, "wall_time": m.wall_time}
        return (source_id, m.offset, 0, RESTART, json.dumps(restart))
    body: dict[str, Any] = {"hparams": [list(p) for p in m.hparams], "metrics": list(m.metrics)}
    return (source_id, m.offset, m.index, HPARAMS, json.dumps(body))


def _mark_of(row: tuple[int, str, int, int, str, str]) -> SpooledMark:
    id_, source_id, offset, index, kind, text = row
    body = json.loads(text)
    if kind == RESTART:
        tags = body["tags"]
        return SpooledMark(
            int(id_),
            RestartMark(
                source_id,
                source_id,
                int(offset),
                int(body["step"]),
                None if tags is None else tuple(str(t) for t in tags),
                body["wall_time"],
            ),
        )
    return SpooledMark(
        int(id_),
        HParamsMark(
            source_id,
            source_id,
            int(offset),
            int(index),
            tuple((str(n), str(v)) for n, v in body["hparams"]),
            tuple(str(m) for m in body["metrics"]),
        ),
    )


class Spool:
    """Open with :meth:`open`; every method is blocking (run it in a worker thread)."""

    def __init__(self, db: sqlite3.Connection, path: Path, max_points: int) -> None:
        self._db = db
        self.path = path
        self.max_points = max_points
        (depth,) = db.execute("SELECT COUNT(*) FROM points").fetchone()
        self._depth: int = int(depth)
        self._screen = PointScreen()

    @classmethod
    def open(cls, path: Path, max_points: int = DEFAULT_MAX_POINTS) -> Spool:
        if max_points < 1:
            raise SpoolError(f"the spool limit is {max_points} points; it must be at least 1")
        try:
            db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.execute("PRAGMA busy_timeout=10000")
            for sql in _SCHEMA:
                db.execute(sql)
        except sqlite3.DatabaseError as exc:
            raise SpoolError(
                f"the spool {path} cannot be opened ({exc}). If the disk damaged it, move it "
                "aside: the collector re-reads the telemetry files from its checkpoint, and "
                "points the gateway already stored are not stored twice"
            ) from None
        return cls(db, path, max_points)

    def close(self) -> None:
        self._db.close()

    @property
    def depth(self) -> int:
        """Points waiting for the gateway's acknowledgement."""
        return self._depth

    def full(self) -> bool:
        return self._depth >= self.max_points

    def append(
        self,
        points: Sequence[ScalarPoint],
        warnings: Sequence[ReadWarning],
        marks: Sequence[Mark] = (),
    ) -> int:
        """Make ``points``, ``warnings`` and ``marks`` durable in one transaction; returns
        points added."""
        # The tailer screened these already; screening again costs little and means no caller
        # can put a point into the spool that the gateway would refuse or SQLite cannot hold.
        good, refused = self._screen.screen(points, time.time())
        marks, unshippable = screen_marks(marks)
        refused += unshippable
        rows = [
            (
                p.source_id or p.source,
                p.offset,
                p.index,
                p.tag,
                p.step,
                p.wall_time,
                None if math.isnan(p.value) else p.value,
            )
            for p in good
        ]
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            cursor = db.executemany(
                "INSERT INTO points (source_id, byte_offset, value_index, tag, step, wall_time, "
                "value) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                rows,
            )
            added = max(cursor.rowcount, 0)
            db.executemany(
                "INSERT INTO warnings (source, byte_offset, kind, data_loss, message) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                [_warning_row(w) for w in [*warnings, *refused]],
            )
            if marks:
                db.executemany(
                    "INSERT INTO marks (source_id, byte_offset, value_index, kind, body) "
                    "VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                    [_mark_row(m) for m in marks],
                )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        self._depth += added
        return added

    def peek(self, limit: int) -> list[SpooledPoint]:
        """The oldest ``limit`` waiting points, in the order they were spooled."""
        rows = self._db.execute(
            "SELECT id, source_id, byte_offset, value_index, tag, step, wall_time, value "
            "FROM points ORDER BY id LIMIT ?",
            (limit,),
        ).fetchall()
        return [
            SpooledPoint(
                int(r[0]),
                str(r[1]),
                int(r[2]),
                int(r[3]),
                str(r[4]),
                int(r[5]),
                None if r[6] is None else float(r[6]),
                math.nan if r[7] is None else float(r[7]),
            )
            for r in rows
        ]

    def peek_marks(self, limit: int) -> list[SpooledMark]:
        """The oldest ``limit`` waiting marks, in the order they were spooled."""
        rows = self._db.execute(
            "SELECT id, source_id, byte_offset, value_index, kind, body FROM marks "
            "ORDER BY id LIMIT ?",
            (limit,),
        ).fetchall()
        return [_mark_of(r) for r in rows]

    def acknowledge(
        self, upto_id: int, refused: Sequence[ReadWarning] = (), marks_upto: int = 0
    ) -> int:
        """Drop every point with ``id <= upto_id`` (the gateway stored them, or refused them for
        good: ``refused`` records those as data-loss warnings in the same transaction, so a
        crash between the two can neither lose the record nor keep the point). Returns how many
        points left. ``marks_upto`` acknowledges the marks up to that id the same way."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            cursor = db.execute("DELETE FROM points WHERE id <= ?", (upto_id,))
            removed = max(cursor.rowcount, 0)
            if marks_upto:
                db.execute("DELETE FROM marks WHERE id <= ?", (marks_upto,))
            db.executemany(
                "INSERT INTO warnings (source, byte_offset, kind, data_loss, message) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                [_warning_row(w) for w in refused],
            )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        self._depth -= removed
        return removed

    def warning_counts(self) -> tuple[int, int]:
        """(every warning, data-loss warnings) recorded since this spool was made."""
        total, lost = self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(data_loss), 0) FROM warnings"
        ).fetchone()
        return int(total), int(lost)


def _warning_row(w: ReadWarning) -> tuple[str, int, str, int, str]:
    """A warning as a row; a file name that is not UTF-8 is kept as escapes, not a crash."""
    return (storable(w.source), w.offset, w.kind, int(w.data_loss), storable(w.message))
