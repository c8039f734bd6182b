"""The journal's SQLite connection: opening it (integrity check, WAL, ``synchronous=FULL``,
migrations) and running one serialised, shielded transaction at a time.

Rules:
- :class:`JournalDb` is the bottom layer of :class:`~tuneplane.agent.journal.Journal`; the
  layers above it read through :meth:`JournalDb.read` and write only through
  :meth:`JournalDb.write`, one ``BEGIN IMMEDIATE`` ... ``COMMIT`` per call.
- A file that is not a sound SQLite database, or fails ``PRAGMA integrity_check``, is
  :class:`JournalCorrupt`; a schema newer than :mod:`tuneplane.agent.journal_schema` knows is
  :class:`JournalTooNew`. aiosqlite runs through :mod:`tuneplane.agent.adapter`.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import aiosqlite
import trio

from .adapter import run_aio
from .journal_changes import MemberChanges
from .journal_records import JournalCorrupt, JournalError, JournalTooNew
from .journal_schema import MIGRATIONS
from .xid_book import NewHealthEvent

log = logging.getLogger(__name__)


async def fetchall(db: aiosqlite.Connection, sql: str, args: Sequence[Any] = ()) -> list[Any]:
    """Every row ``sql`` selects (or a statement's RETURNING clause gives), on the asyncio side
    (inside a write or at open): one trip to aiosqlite's thread, not three."""
    return list(await db.execute_fetchall(sql, args))


class JournalDb:
    """The open journal's connection. Create with :meth:`open` inside ``adapter.open_aio_host()``.

    Methods are Trio-async; each write is one SQLite transaction, serialised by a lock and shielded
    from cancellation so a cancelled caller never leaves a half-written transaction behind.
    """

    def __init__(self, db: aiosqlite.Connection, path: Path, journal_id: str = "") -> None:
        self._db = db
        self.path = path
        self._lock = trio.Lock()
        #: This journal's random identity (``meta.journal_id``), sent with every report.
        self.journal_id = journal_id
        #: Told the seconds each write's COMMIT (its fsync) took; the daemon's metrics set it.
        self.on_commit: Callable[[float], None] | None = None
        #: Which members changed, for the loops that follow them (noted after each commit).
        self.changes = MemberChanges()

    # --- opening -----------------------------------------------------------------------------

    @classmethod
    async def open(cls, path: Path) -> Self:
        """Open (creating if absent), check integrity, and migrate the journal at ``path``.

        Raises :class:`JournalCorrupt` when the file is not a sound SQLite database, and
        :class:`JournalTooNew` when its schema is newer than this agent knows.
        """
        db = await run_aio(_aio_open, path)
        rows = await run_aio(fetchall, db, "SELECT value FROM meta WHERE key = 'journal_id'")
        return cls(db, path, str(rows[0][0]))

    async def close(self) -> None:
        async with self._lock:
            with trio.CancelScope(shield=True):
                await run_aio(self._db.close)

    async def read(self, sql: str, args: Sequence[Any] = ()) -> list[Any]:
        """Run one query, serialised with the writes, and return its rows."""
        async with self._lock:
            return await run_aio(fetchall, self._db, sql, args)

    async def read_if_changed(
        self, queries: Sequence[str], seen_version: int | None
    ) -> tuple[int, list[list[Any]] | None]:
        """SQLite's ``data_version`` and each query's rows, in one trip; the rows are None when
        the version is still ``seen_version``.

        The version moves only when another connection (another process) committed: a caller
        that caches what it read must also drop that cache after its own writes.
        """
        async with self._lock:
            return await run_aio(_aio_read_if_changed, self._db, queries, seen_version)

    async def write(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(db, *args)`` as one transaction, serialised and shielded; return its result."""
        async with self._lock:
            with trio.CancelScope(shield=True):
                return await run_aio(
                    _aio_transaction, self._db, fn, *args, on_commit=self.on_commit
                )


async def insert_event(
    db: aiosqlite.Connection,
    at_ms: int,
    member_key: str | None,
    kind: str,
    from_state: str | None,
    to_state: str | None,
    reason: str,
    details: Mapping[str, Any],
) -> None:
    """Append one ``events`` row, inside the caller's transaction."""
    await db.execute(
        "INSERT INTO events (at_ms, member_key, kind, from_state, to_state, reason, details) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)",
        (at_ms, member_key, kind, from_state, to_state, reason, json.dumps(dict(details))),
    )


async def insert_health(db: aiosqlite.Connection, r: NewHealthEvent) -> None:
    """Append one ``gpu_health_events`` row, inside the caller's transaction."""
    await db.execute(
        "INSERT INTO gpu_health_events (gpu_uuid, at_ms, kind, actor, reason, through_xid_id, "
        "recovery_action) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (r.uuid, r.at_ms, r.kind, r.actor, r.reason, r.through_xid_id, r.recovery_action),
    )


async def _aio_read_if_changed(
    db: aiosqlite.Connection, queries: Sequence[str], seen_version: int | None
) -> tuple[int, list[list[Any]] | None]:
    ((version,),) = await fetchall(db, "PRAGMA data_version")
    if version == seen_version:
        return version, None
    return version, [await fetchall(db, sql) for sql in queries]


async def _aio_transaction(
    db: aiosqlite.Connection,
    fn: Any,
    *args: Any,
    on_commit: Callable[[float], None] | None = None,
) -> Any:
    """Run ``fn(db, *args)`` inside BEGIN IMMEDIATE ... COMMIT; roll back on any error.

    ``on_commit`` is told how long the COMMIT took: with ``synchronous=FULL`` that is the fsync
    every journaled state change waits for.
    """
    await db.execute("BEGIN IMMEDIATE")
    try:
        result = await fn(db, *args)
    except BaseException:
        await db.execute("ROLLBACK")
        raise
    started = time.perf_counter()
    await db.execute("COMMIT")
    if on_commit is not None:
        on_commit(time.perf_counter() - started)
    return result


async def _aio_open(path: Path) -> aiosqlite.Connection:
    try:
        db = await aiosqlite.connect(str(path), isolation_level=None)
    except sqlite3.DatabaseError as exc:
        raise JournalCorrupt(f"The journal {path} cannot be opened: {exc}.") from None
    try:
        await db.execute("PRAGMA busy_timeout = 5000")
        check = await fetchall(db, "PRAGMA integrity_check")
        if [tuple(r) for r in check] != [("ok",)]:
            problems = "; ".join(str(r[0]) for r in check[:3])
            raise JournalCorrupt(f"The journal {path} failed its integrity check: {problems}.")
        mode = await fetchall(db, "PRAGMA journal_mode = WAL")
        if str(mode[0][0]).lower() != "wal":
            raise JournalError(f"The journal {path} could not switch to WAL mode ({mode[0][0]}).")
        await db.execute("PRAGMA synchronous = FULL")
        await db.execute("PRAGMA foreign_keys = ON")
        await _aio_migrate(db, path)
    except sqlite3.DatabaseError as exc:
        await db.close()
        raise JournalCorrupt(f"The journal {path} is not a sound SQLite database: {exc}.") from None
    except BaseException:
        await db.close()
        raise
    return db


async def _aio_migrate(db: aiosqlite.Connection, path: Path) -> None:
    version = int((await fetchall(db, "PRAGMA user_version"))[0][0])
    if version > len(MIGRATIONS):
        raise JournalTooNew(
            f"The journal {path} has schema version {version}, but this agent knows only up to "
            f"{len(MIGRATIONS)}; run the newer tuneplane-node that wrote it."
        )
    for number in range(version + 1, len(MIGRATIONS) + 1):

        async def step(db: aiosqlite.Connection, number: int = number) -> None:
            for statement in MIGRATIONS[number - 1].split(";"):
                if statement.strip():
                    await db.execute(statement)
            await db.execute(
                "INSERT INTO meta (key, value) VALUES ('schema_version', ?) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (str(number),),
            )
            # PRAGMA user_version is transactional in SQLite, so it moves with the migration.
            await db.execute(f"PRAGMA user_version = {number}")

        await _aio_transaction(db, step)
        log.info("journal migrated path=%s schema_version=%d", path, number)
