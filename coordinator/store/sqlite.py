"""The SQLite backend of a store: one file, one aiosqlite connection, one writer.

Rules:
- WAL, ``synchronous=FULL``, ``busy_timeout``: a returned write is on disk, and other processes
  (the admin CLI, an on-call's ``sqlite3``) may open the same file meanwhile.
- A transaction is ``BEGIN IMMEDIATE`` ... ``COMMIT``: it takes the file's write lock first, so
  writers in every process are serialised by SQLite itself and never conflict; nothing here is
  ever re-run. A lock still held by another process after ``busy_timeout`` is
  :class:`StoreUnavailable`.
- Rows are :class:`sqlite3.Row` (by index and by name). Integrity errors become
  :class:`IntegrityViolation`.
- Heavy reads (:meth:`SqliteBackend.snapshot`) run in a worker thread on a read-only connection
  of their own, in one read transaction, so a million rows never stall the event loop or the
  writer.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager, closing, contextmanager
from pathlib import Path
from typing import Any, TypeVar

import aiosqlite
import anyio

from .handle import (
    Handle,
    IntegrityViolation,
    Result,
    Row,
    SnapshotReader,
    StoreUnavailable,
    integrity_sentence,
)

BUSY_TIMEOUT_MS = 10_000
T = TypeVar("T")


class SqliteHandle:
    """A :class:`~tuneplane.coordinator.store.handle.Handle` on the store's one connection."""

    def __init__(self, conn: aiosqlite.Connection, what: str) -> None:
        self._conn = conn
        self._what = what

    @contextmanager
    def _mapped(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.IntegrityError as exc:
            raise IntegrityViolation(integrity_sentence(self._what, str(exc))) from exc
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc):
                raise
            raise StoreUnavailable(
                f"the {self._what} stayed locked by another process for "
                f"{BUSY_TIMEOUT_MS // 1000} s ({exc}); nothing was changed. Find the process "
                "holding it (a long `sqlite3` session?), end it, and try again."
            ) from exc

    async def execute(self, sql: str, args: Sequence[Any] = ()) -> Result:
        with self._mapped():
            cursor = await self._conn.execute(sql, tuple(args))
        return Result(int(cursor.rowcount))

    async def execute_fetchall(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        with self._mapped():
            return list(await self._conn.execute_fetchall(sql, tuple(args)))

    async def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> Result:
        # A generator is read by sqlite3 in the connection's thread, off the event loop.
        with self._mapped():
            cursor = await self._conn.executemany(sql, rows)
        return Result(int(cursor.rowcount))

    async def fetchone(self, sql: str, args: Sequence[Any] = ()) -> Row | None:
        rows = await self.execute_fetchall(sql, args)
        return rows[0] if rows else None


async def _into_wal(conn: aiosqlite.Connection) -> None:
    """Switch the file to WAL. The switch needs the file to itself and SQLite answers "locked"
    at once, without its busy handler, while another connection opens it too (two processes
    starting together): try again until the busy timeout has passed."""
    deadline = anyio.current_time() + BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            await conn.execute("PRAGMA journal_mode=WAL")
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or anyio.current_time() > deadline:
                raise
            await anyio.sleep(0.02)
        else:
            return


class SqliteBackend:
    """One store's SQLite file. Open with :meth:`open`."""

    def __init__(self, conn: aiosqlite.Connection, path: Path, what: str) -> None:
        self._conn = conn
        self.path = path
        self.reader: Handle = SqliteHandle(conn, what)

    @classmethod
    async def open(cls, path: Path, what: str, foreign_keys: bool) -> SqliteBackend:
        conn = await aiosqlite.connect(path, isolation_level=None)
        try:
            conn.row_factory = sqlite3.Row
            await conn.execute("PRAGMA synchronous=FULL")
            await conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            await _into_wal(conn)
            if foreign_keys:
                await conn.execute("PRAGMA foreign_keys=ON")
        except BaseException:
            await conn.close()
            raise
        return cls(conn, path, what)

    async def close(self) -> None:
        await self._conn.close()

    async def abandon(self) -> None:
        """A SQLite file has no link to lose: the same as :meth:`close`."""
        await self._conn.close()

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Handle]:
        await self.reader.execute("BEGIN IMMEDIATE")
        try:
            yield self.reader
        except BaseException:
            await self._conn.execute("ROLLBACK")
            raise
        await self.reader.execute("COMMIT")

    def migration_sql(self, sql: str) -> str:
        """Migrations are written in SQLite's dialect: as they are."""
        return sql

    async def prepare_home(self, db: Handle) -> None:
        """A file needs no schema of its own."""

    async def table_facts(self) -> tuple[list[str], list[tuple[str, str]]]:
        """The file's tables, and (table, table it references) for each foreign key."""
        names = [
            str(r[0])
            for r in await self.reader.execute_fetchall(
                "SELECT name FROM sqlite_master WHERE type = 'table' "
                "AND name NOT LIKE 'sqlite_%' ORDER BY name"
            )
        ]
        edges: list[tuple[str, str]] = []
        for name in names:
            for fk in await self.reader.execute_fetchall(
                'SELECT "table" FROM pragma_foreign_key_list(?)', (name,)
            ):
                edges.append((name, str(fk[0])))
        return names, edges

    async def columns(self, table: str) -> list[str]:
        rows = await self.reader.execute_fetchall(
            "SELECT name FROM pragma_table_info(?) ORDER BY cid", (table,)
        )
        return [str(r[0]) for r in rows]

    async def after_insert(self, db: Handle, table: str) -> None:
        """SQLite numbers the next row past the largest id itself."""

    async def snapshot(self, work: Callable[[SnapshotReader], T]) -> T:
        """``work`` in a worker thread, reading one snapshot on a read-only connection of its
        own."""
        return await anyio.to_thread.run_sync(_in_snapshot, self.path, work)

    async def batches(self, sql: str, size: int) -> AsyncIterator[list[Row]]:
        """The rows of ``sql`` in lists of at most ``size``, read on the store's connection."""
        async with self._conn.execute(sql) as cursor:
            while chunk := await cursor.fetchmany(size):
                yield list(chunk)


def _in_snapshot(path: Path, work: Callable[[SnapshotReader], T]) -> T:
    uri = f"file:{path}?mode=ro"
    with closing(sqlite3.connect(uri, uri=True, isolation_level=None)) as db:
        db.execute("BEGIN")
        try:
            return work(db)
        finally:
            db.execute("ROLLBACK")
