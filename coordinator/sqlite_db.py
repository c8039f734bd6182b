"""What every coordinator SQLite file shares: durable settings, versioned migrations, one writer.

Rules:
- One aiosqlite connection per file, WAL, ``synchronous=FULL``, ``busy_timeout``: a returned
  write is on disk, and other processes (the admin CLI) may open the same file meanwhile.
- Writes are ``BEGIN IMMEDIATE`` ... ``COMMIT`` under one lock (:meth:`SqliteFile._txn`), run
  *shielded* (:meth:`SqliteFile._shielded`): a caller's deadline may stop waiting, but never
  leaves half a transaction behind. :meth:`SqliteFile.close` waits for those still running.
- Migrations are numbered and applied in order, each in its own transaction; a file newer than
  this code is refused rather than guessed at.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, ClassVar, Self, TypeVar

import aiosqlite
import anyio

log = logging.getLogger(__name__)

BUSY_TIMEOUT_MS = 10_000
T = TypeVar("T")
Migrations = tuple[tuple[int, tuple[str, ...]], ...]


class StoreError(Exception):
    """Base of the store errors; the message is a sentence for the caller."""


class SchemaTooNew(StoreError):
    """The file was written by a newer coordinator."""


class SqliteFile:
    """Base of one SQLite-backed store. Open with :meth:`open`; close with :meth:`close`."""

    #: What the file is called in messages ("store", "log store", ...).
    LABEL: ClassVar[str]
    #: The one-row table holding this file's schema version.
    VERSION_TABLE: ClassVar[str]
    MIGRATIONS: ClassVar[Migrations]
    FOREIGN_KEYS: ClassVar[bool] = False

    def __init__(self, db: aiosqlite.Connection, path: Path) -> None:
        self._db = db
        self.path = path
        self._lock = anyio.Lock()
        self._inflight: set[asyncio.Task[Any]] = set()

    @classmethod
    async def open(cls, path: Path) -> Self:
        db = await aiosqlite.connect(path, isolation_level=None)
        try:
            await db.execute("PRAGMA journal_mode=WAL")
            await db.execute("PRAGMA synchronous=FULL")
            await db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            if cls.FOREIGN_KEYS:
                await db.execute("PRAGMA foreign_keys=ON")
            store = cls(db, path)
            await store._migrate()
        except BaseException:
            await db.close()
            raise
        return store

    async def close(self) -> None:
        """Wait for shielded transactions still running, then close the connection."""
        if self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)
        await self._db.close()

    async def schema_version(self) -> int:
        rows = await self._db.execute_fetchall(f"SELECT version FROM {self.VERSION_TABLE}")
        return int(next(iter(rows))[0])

    @property
    def latest_version(self) -> int:
        return self.MIGRATIONS[-1][0]

    async def _migrate(self) -> None:
        table = self.VERSION_TABLE
        await self._db.execute(f"CREATE TABLE IF NOT EXISTS {table} (version INTEGER NOT NULL)")
        async with self._txn() as db:
            rows = list(await db.execute_fetchall(f"SELECT version FROM {table}"))
            if not rows:
                await db.execute(f"INSERT INTO {table} (version) VALUES (0)")
            current = int(rows[0][0]) if rows else 0
        if current > self.latest_version:
            raise SchemaTooNew(
                f"the {self.LABEL} {self.path} is at schema version {current}, newer than the "
                f"{self.latest_version} this coordinator understands. Run the newer coordinator."
            )
        for version, statements in self.MIGRATIONS:
            if version <= current:
                continue
            async with self._txn() as db:
                for sql in statements:
                    await db.execute(sql)
                await db.execute(f"UPDATE {table} SET version = ?", (version,))
            log.info("%s migrated path=%s version=%d", self.LABEL, self.path, version)

    @asynccontextmanager
    async def _txn(self) -> AsyncIterator[aiosqlite.Connection]:
        async with self._lock:
            await self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                await self._db.execute("ROLLBACK")
                raise
            await self._db.execute("COMMIT")

    async def _shielded(self, work: Awaitable[T]) -> T:
        """Run ``work`` to completion even if the caller is cancelled (a deadline passed)."""

        async def run() -> T:
            return await work

        task = asyncio.ensure_future(run())
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        return await asyncio.shield(task)

    async def _rows(self, sql: str, args: Sequence[Any] = ()) -> list[Any]:
        return list(await self._db.execute_fetchall(sql, tuple(args)))
