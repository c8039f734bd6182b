"""Member logs as Nodes ship them: a bounded tail of each member's stdout and stderr.

Rules:
- Its own SQLite file (``logs.db``: WAL, ``synchronous=FULL``) or PostgreSQL schema
  (``tuneplane_logs``), with its own writer, so chatty workloads never queue behind the store's
  decisions. A chunk is on disk before it is acknowledged.
- Idempotent by byte offset: a stream remembers ``next_offset`` (everything before it is stored
  or deliberately dropped); a resent chunk adds only bytes past it, so nothing is stored twice.
- Bounded: at most :data:`KEEP_BYTES` per member and stream; the oldest chunks go first, and a
  reader is told how many bytes before each piece are missing.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, TypeVar

import attrs

from ..values.jobs import MemberKey
from ..values.lifecycle import LogPiece
from .db import StoreDb
from .handle import Handle

log = logging.getLogger(__name__)

DB_NAME = "logs.db"
#: The most bytes kept per member and stream; older bytes are dropped.
KEEP_BYTES = 1024 * 1024
STREAMS = ("stdout", "stderr")
T = TypeVar("T")

MIGRATIONS: tuple[tuple[int, tuple[str, ...]], ...] = (
    (
        1,
        (
            """CREATE TABLE log_streams (
                run_id TEXT NOT NULL,
                attempt INTEGER NOT NULL,
                member_index INTEGER NOT NULL,
                stream TEXT NOT NULL CHECK (stream IN ('stdout', 'stderr')),
                next_offset BIGINT NOT NULL,
                kept_bytes BIGINT NOT NULL,
                complete INTEGER NOT NULL DEFAULT 0,
                updated_at_ms BIGINT NOT NULL,
                PRIMARY KEY (run_id, attempt, member_index, stream)
            )""",
            """CREATE TABLE log_chunks (
                run_id TEXT NOT NULL,
                attempt INTEGER NOT NULL,
                member_index INTEGER NOT NULL,
                stream TEXT NOT NULL,
                byte_offset BIGINT NOT NULL,
                data BLOB NOT NULL,
                PRIMARY KEY (run_id, attempt, member_index, stream, byte_offset)
            )""",
        ),
    ),
)


class BadStream(ValueError):
    """A stream name other than ``stdout`` or ``stderr``."""


def check_stream(stream: str) -> str:
    if stream not in STREAMS:
        raise BadStream(
            f"the log stream {stream!r} is not one of {', '.join(STREAMS)}. Name one of them."
        )
    return stream


@attrs.frozen
class Appended:
    """The acknowledgement for a chunk: everything before ``offset`` is stored or dropped."""

    offset: int
    complete: bool


@attrs.frozen
class LogRead:
    pieces: tuple[LogPiece, ...]
    next_offset: int
    complete: bool
    dropped_bytes: int


def _key_args(member: MemberKey, stream: str) -> tuple[Any, ...]:
    return (member.run_id, member.attempt, member.member_index, stream)


_WHERE = "run_id = ? AND attempt = ? AND member_index = ? AND stream = ?"


class LogStore(StoreDb):
    """Open with :meth:`open`; close with :meth:`close`."""

    LABEL = "log store"
    VERSION_TABLE = "logs_schema_version"
    SCHEMA = "tuneplane_logs"
    MIGRATIONS = MIGRATIONS

    # ----- writes ------------------------------------------------------------------------------

    async def append(
        self, member: MemberKey, stream: str, offset: int, data: bytes, eof: bool, now: int
    ) -> Appended:
        """Store the part of a chunk past what is already stored; mark the end on ``eof``.

        A chunk that starts past ``next_offset`` means the Node dropped the bytes between (its
        backlog was over the bound); they count as dropped. ``eof`` is recorded only when the
        chunk reaches the stream's end, so an old resent chunk never ends a stream early.
        """
        check_stream(stream)

        async def work() -> Appended:
            async with self.transaction() as db:
                key = _key_args(member, stream)
                rows = list(
                    await db.execute_fetchall(
                        f"SELECT next_offset, kept_bytes, complete FROM log_streams WHERE {_WHERE}",
                        key,
                    )
                )
                if rows:
                    next_offset, kept, complete = int(rows[0][0]), int(rows[0][1]), bool(rows[0][2])
                else:
                    next_offset, kept, complete = 0, 0, False
                    await db.execute(
                        "INSERT INTO log_streams (run_id, attempt, member_index, stream, "
                        "next_offset, kept_bytes, updated_at_ms) VALUES (?, ?, ?, ?, 0, 0, ?)",
                        (*key, now),
                    )
                if complete:
                    return Appended(next_offset, True)
                end = offset + len(data)
                if end > next_offset:
                    start = max(offset, next_offset)
                    fresh = data[start - offset :]
                    if len(fresh) > KEEP_BYTES:
                        start, fresh = end - KEEP_BYTES, fresh[-KEEP_BYTES:]
                    if fresh:
                        await db.execute(
                            "INSERT INTO log_chunks (run_id, attempt, member_index, stream, "
                            "byte_offset, data) VALUES (?, ?, ?, ?, ?, ?)",
                            (*key, start, fresh),
                        )
                    kept += len(fresh)
                    next_offset = end
                    kept = await self._trim(db, key, kept)
                if eof and end >= next_offset:
                    complete = True
                await db.execute(
                    "UPDATE log_streams SET next_offset = ?, kept_bytes = ?, complete = ?, "
                    f"updated_at_ms = ? WHERE {_WHERE}",
                    (next_offset, kept, int(complete), now, *key),
                )
                return Appended(next_offset, complete)

        return await self.shielded(work)

    async def _trim(self, db: Handle, key: tuple[Any, ...], kept: int) -> int:
        """Drop the oldest chunks until at most KEEP_BYTES remain; returns the bytes kept."""
        while kept > KEEP_BYTES:
            rows = list(
                await db.execute_fetchall(
                    f"SELECT byte_offset, length(data) FROM log_chunks WHERE {_WHERE} "
                    "ORDER BY byte_offset LIMIT 1",
                    key,
                )
            )
            if not rows:
                return 0
            await db.execute(
                f"DELETE FROM log_chunks WHERE {_WHERE} AND byte_offset = ?", (*key, rows[0][0])
            )
            kept -= int(rows[0][1])
        return kept

    # ----- reads -------------------------------------------------------------------------------

    async def read(
        self, member: MemberKey, stream: str, from_offset: int, max_bytes: int
    ) -> LogRead:
        """Kept bytes at or after ``from_offset``, at most ``max_bytes`` of them, in order."""
        check_stream(stream)
        key = _key_args(member, stream)
        rows = await self.reader.execute_fetchall(
            f"SELECT next_offset, kept_bytes, complete FROM log_streams WHERE {_WHERE}", key
        )
        if not rows:
            return LogRead((), from_offset, False, 0)
        end, kept, complete = int(rows[0][0]), int(rows[0][1]), bool(rows[0][2])
        chunks = await self.reader.execute_fetchall(
            f"SELECT byte_offset, data FROM log_chunks WHERE {_WHERE} "
            "AND byte_offset + length(data) > ? ORDER BY byte_offset",
            (*key, from_offset),
        )
        pieces: list[LogPiece] = []
        cursor, budget = from_offset, max_bytes
        for chunk_offset, data in chunks:
            if budget <= 0:
                break
            start = max(int(chunk_offset), cursor)
            part = bytes(data)[start - int(chunk_offset) :][:budget]
            pieces.append(LogPiece(start, part, start - cursor))
            cursor = start + len(part)
            budget -= len(part)
        if budget > 0 and cursor < end:
            # Every kept byte was returned, yet the stream goes on: the rest was dropped.
            pieces.append(LogPiece(end, b"", end - cursor))
            cursor = end
        next_offset = max(cursor, from_offset)
        return LogRead(tuple(pieces), next_offset, complete and next_offset >= end, end - kept)

    async def tail(self, member: MemberKey, stream: str, max_bytes: int) -> tuple[bytes, int]:
        """The last kept bytes of a stream, at most ``max_bytes``, and the offset they start at
        (0: they begin at the stream's first byte)."""
        check_stream(stream)
        rows = await self.reader.execute_fetchall(
            f"SELECT next_offset FROM log_streams WHERE {_WHERE}", _key_args(member, stream)
        )
        if not rows:
            return b"", 0
        start = max(0, int(rows[0][0]) - max_bytes)
        read = await self.read(member, stream, start, max_bytes)
        pieces = [p for p in read.pieces if p.data]
        if not pieces:
            return b"", start
        # Bytes dropped inside the window leave a gap: only what follows the last gap is shown.
        last_gap = max((i for i, p in enumerate(pieces) if p.dropped_before), default=0)
        kept = pieces[last_gap:]
        return b"".join(p.data for p in kept), kept[0].offset


def logs_db_path(state_dir: Path) -> Path:
    return state_dir / DB_NAME
