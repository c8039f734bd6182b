"""The SQLite backend of a store: one file, one connection, one writer.

Rules:
- WAL, ``synchronous=FULL``, ``busy_timeout``: a returned write is on disk, and other processes
  (the admin CLI, an on-call's ``sqlite3``) may open the same file meanwhile.
- A transaction is ``BEGIN IMMEDIATE`` ... ``COMMIT``: it takes the file's write lock first, so
  writers in every process are serialised by SQLite itself and never conflict; nothing here is
  ever re-run. A lock still held by another process after ``busy_timeout`` is
  :class:`StoreUnavailable`. This process's write blocks queued behind one another share one
  such transaction, each in a savepoint, and its one ``COMMIT`` (:mod:`.sqlite_group`).
- Where a statement runs (:mod:`.sqlite_link`): whatever can wait on another process or on the
  disk runs in a worker thread: ``BEGIN IMMEDIATE`` that finds the write lock taken (the busy
  wait), ``COMMIT`` (the fsync), ``ROLLBACK``, opening, closing, and a read outside a
  transaction that turns out long (a Job list, a metric series: below, how it is told). In a
  store that asks for it (``on_loop``: the main store, whose transactions touch a Job's or a
  Node's few rows), ``BEGIN IMMEDIATE`` is first tried on the event loop with SQLite's busy wait
  off (it refuses at once when another process holds the lock), and the statements *inside* a
  write transaction run there: the file's write lock is already ours, so none of them waits on
  anything, and a trip to a thread and back for each (a queue, a future, a wake-up of the loop)
  cost more than the statement. What is proportional to a request's size still goes to the
  thread, as every such step does (docs/security.md): a batch of many rows
  (:data:`INLINE_ROWS`), bound values of more than :data:`INLINE_BYTES`, and a read naming a
  column that can hold megabytes (:data:`LARGE_COLUMNS`, the JobSpec).
- A read outside a transaction (a ``SELECT`` through ``reader``) in such a store is tried on the
  loop, bounded: SQLite's busy wait off, at most :data:`INLINE_READ_OPS` of its virtual-machine
  instructions (a progress handler interrupts it past them) and :data:`INLINE_ROWS` rows. A read
  past a bound, or one SQLite would make wait for another process's lock, is dropped (a read
  changed nothing) and runs again in the thread, wait back on: the loop never holds for more
  than the bound, and a credential, a Fleet's settings or a scheduling pass's few rows cost no
  trip to the thread.
- The connection is used by one thread at a time: a statement for the loop that finds the
  connection busy in the thread waits for it without blocking the loop. Only data crosses
  between the threads: each call closes the cursor it opened (a cursor dropped later, in the
  other thread, would reset its statement while that thread runs the next one). The one
  exception, :meth:`SqliteBackend.batches`, uses and closes its cursor in the thread only.
- Rows are :class:`sqlite3.Row` (by index and by name). Integrity errors become
  :class:`IntegrityViolation`.
- Heavy reads (:meth:`SqliteBackend.snapshot`) run in a worker thread on a read-only connection
  of their own, in one read transaction, so a million rows never stall the event loop or the
  writer.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import AbstractContextManager, asynccontextmanager, closing
from pathlib import Path
from typing import Any, TypeVar

import anyio

from .handle import (
    Handle,
    Result,
    Row,
    SnapshotReader,
)
from .sqlite_group import CommitGroups
from .sqlite_link import BUSY_TIMEOUT_MS, INLINE_ROWS, SqliteLink, mapped_errors, read_rows, waits

#: The most bytes of bound values (strings and blobs) a statement writes on the event loop.
INLINE_BYTES = 64 * 1024
#: Columns whose value can be megabytes (a resolved JobSpec of 8 MiB of experiment files, the
#: capsule made from it): a read naming one runs in the worker thread, since what it returns
#: cannot be sized beforehand. A write is sized by its bound values.
LARGE_COLUMNS = ("resolved_json", "capsule_json")
T = TypeVar("T")


class SqliteHandle:
    """A :class:`~tuneplane.coordinator.store.handle.Handle` on the store's one connection.
    ``in_transaction``: its small statements run on the event loop; ``bounded_reads``: its
    ``SELECT`` s are tried there, within bounds (:meth:`SqliteLink.read_bounded`); everything
    else runs in the worker thread."""

    def __init__(
        self, link: SqliteLink, what: str, in_transaction: bool, bounded_reads: bool = False
    ) -> None:
        self._link = link
        self._what = what
        self._in_transaction = in_transaction
        self._bounded_reads = bounded_reads

    def _mapped(self) -> AbstractContextManager[None]:
        return mapped_errors(self._what)

    async def _run(self, small: bool, call: Callable[[], T]) -> T:
        """``call`` on the loop when ``small`` and this handle runs such calls there, else in
        the worker thread."""
        if small and self._in_transaction:
            return await self._link.inline(call)
        return await self._link.threaded(call)

    async def execute(self, sql: str, args: Sequence[Any] = ()) -> Result:
        conn, values = self._link.conn, tuple(args)
        with self._mapped():
            return await self._run(_small((values,)), lambda: _changed(conn.execute(sql, values)))

    async def execute_fetchall(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        conn, values = self._link.conn, tuple(args)
        # What a read returns cannot be sized beforehand: its columns say.
        small = not any(c in sql for c in LARGE_COLUMNS) and _small((values,))
        with self._mapped():
            if small and self._bounded_reads and _selects(sql):
                rows = self._link.read_bounded(sql, values)
                if rows is not None:
                    return rows
            return await self._run(small, lambda: read_rows(conn.execute(sql, values)))

    async def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> Result:
        conn = self._link.conn
        # A generator is read by sqlite3 where the statement runs: never on the loop.
        small = isinstance(rows, list | tuple) and len(rows) <= INLINE_ROWS and _small(rows)
        with self._mapped():
            return await self._run(small, lambda: _changed(conn.executemany(sql, rows)))

    async def fetchone(self, sql: str, args: Sequence[Any] = ()) -> Row | None:
        rows = await self.execute_fetchall(sql, args)
        return rows[0] if rows else None


def _small(rows: Sequence[Sequence[Any]]) -> bool:
    """Whether a statement's bound values are few enough bytes for the event loop."""
    size = 0
    for row in rows:
        for value in row:
            if isinstance(value, str | bytes):
                size += len(value)
    return size <= INLINE_BYTES


def _selects(sql: str) -> bool:
    """Whether ``sql`` is a ``SELECT`` (outside a transaction, anything else may write, and a
    write commits with an fsync)."""
    return sql.lstrip()[:6].upper() == "SELECT"


def _changed(cursor: sqlite3.Cursor) -> Result:
    """What a statement changed, its cursor closed: a statement left open would make the next
    ``COMMIT`` fail with "SQL statements in progress"."""
    with closing(cursor):
        return Result(int(cursor.rowcount))


def _begin(link: SqliteLink) -> Result:
    return _changed(link.conn.execute("BEGIN IMMEDIATE"))


def _pragma(link: SqliteLink, sql: str) -> Callable[[], list[Row]]:
    return lambda: read_rows(link.conn.execute(sql))


def _connect(path: Path) -> sqlite3.Connection:
    # Used from the loop and from worker threads, one at a time (:class:`SqliteLink`).
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.row_factory = sqlite3.Row
    return conn


async def _into_wal(link: SqliteLink) -> None:
    """Switch the file to WAL. The switch needs the file to itself and SQLite answers "locked"
    at once, without its busy handler, while another connection opens it too (two processes
    starting together): try again until the busy timeout has passed."""
    deadline = anyio.current_time() + BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            await link.threaded(_pragma(link, "PRAGMA journal_mode=WAL"))
        except sqlite3.OperationalError as exc:
            if not waits(exc) or anyio.current_time() > deadline:
                raise
            await anyio.sleep(0.02)
        else:
            return


class SqliteBackend:
    """One store's SQLite file. Open with :meth:`open`."""

    def __init__(self, link: SqliteLink, path: Path, what: str, on_loop: bool) -> None:
        self._link = link
        self._on_loop = on_loop
        self.path = path
        self.reader: Handle = SqliteHandle(link, what, in_transaction=False, bounded_reads=on_loop)
        self._writer = SqliteHandle(link, what, in_transaction=on_loop)
        self.groups = CommitGroups(link, what, self._begin, self._writer.execute)

    @classmethod
    async def open(
        cls, path: Path, what: str, foreign_keys: bool, on_loop: bool = True
    ) -> SqliteBackend:
        """Open ``path``; ``on_loop``: whether a write transaction's small statements run on the
        event loop (module rules) or, like everything else, in the worker thread."""
        link = SqliteLink(await anyio.to_thread.run_sync(_connect, path))
        try:
            await link.threaded(_pragma(link, "PRAGMA synchronous=FULL"))
            await link.threaded(_pragma(link, f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}"))
            await _into_wal(link)
            if foreign_keys:
                await link.threaded(_pragma(link, "PRAGMA foreign_keys=ON"))
        except BaseException:
            await link.close()
            raise
        return cls(link, path, what, on_loop)

    async def close(self) -> None:
        await self._link.close()

    async def abandon(self) -> None:
        """A SQLite file has no link to lose: the same as :meth:`close`."""
        await self.close()

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Handle]:
        """One write block, in a group of those queued behind one another (:mod:`.sqlite_group`):
        on disk when the block's ``async with`` ends."""
        async with self.groups.member():
            yield self._writer

    async def _begin(self) -> None:
        link = self._link
        begun = self._on_loop and link.unwaiting(lambda: _begin(link)) is not None
        if not begun:  # another process holds the write lock: wait for it in the thread
            await self.reader.execute("BEGIN IMMEDIATE")

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
        """The rows of ``sql`` in lists of at most ``size``, read on the store's connection in
        the worker thread."""
        cursor = await self._link.threaded(lambda: self._link.conn.execute(sql))
        try:
            while chunk := await self._link.threaded(lambda: cursor.fetchmany(size)):
                yield list(chunk)
        finally:
            await self._link.threaded(cursor.close)


def _in_snapshot(path: Path, work: Callable[[SnapshotReader], T]) -> T:
    uri = f"file:{path}?mode=ro"
    with closing(sqlite3.connect(uri, uri=True, isolation_level=None)) as db:
        db.execute("BEGIN")
        try:
            return work(db)
        finally:
            db.execute("ROLLBACK")
