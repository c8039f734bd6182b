"""Where the SQLite store runs each statement (coordinator/store/sqlite.py).

Statements inside a write transaction run on the event loop: the file's write lock is already
held, so none of them waits, and a trip to a thread for each cost more than the statement (issue
13, goal 2). What can wait runs in the store's one worker thread: ``BEGIN IMMEDIATE`` (another
process's lock), ``COMMIT`` (the fsync), batches of many rows, and a ``SELECT`` outside a
transaction once it goes past its bounds on the loop (SQLite's instructions, rows) or SQLite
would make it wait. The connection is never used by two threads at once. SQLite's own trace
callback says which thread ran each statement; a SQL function that blocks holds the worker
thread for as long as a test needs.
"""

from __future__ import annotations

import asyncio
import sqlite3
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, closing
from pathlib import Path
from typing import Any

import pytest

from tuneplane.coordinator.store.core import Store
from tuneplane.coordinator.store.db import StoreDb
from tuneplane.coordinator.store.logs import LogStore
from tuneplane.coordinator.store.sqlite import INLINE_BYTES, LARGE_COLUMNS, SqliteBackend
from tuneplane.coordinator.store.sqlite_link import BUSY_TIMEOUT_MS, INLINE_READ_OPS, INLINE_ROWS
from tuneplane.coordinator.store.telemetry import TelemetryStore

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.sqlite_only("its subject is the SQLite backend's threads"),
]

LOOP = threading.current_thread().name
WORKER = "store-sqlite"


class Traced:
    """Every statement the store's connection runs, with the thread that ran it."""

    def __init__(self, backend: SqliteBackend) -> None:
        self.seen: list[tuple[str, str]] = []
        self.held = threading.Event()
        self.release = threading.Event()
        conn = backend._link.conn  # the store's one connection, set up while its thread idles
        conn.set_trace_callback(self._trace)
        conn.create_function("hold", 0, self._hold)

    def _trace(self, sql: str) -> None:
        self.seen.append((" ".join(sql.split()), threading.current_thread().name))

    def _hold(self) -> int:
        self.seen.append(("hold() started", threading.current_thread().name))
        self.held.set()
        assert self.release.wait(30), "the test never released hold()"
        self.seen.append(("hold() ended", threading.current_thread().name))
        return 1

    def threads(self, part: str) -> set[str]:
        """The threads that ran statements holding ``part`` (SQLite traces them with their
        values bound, comments kept)."""
        return {thread for sql, thread in self.seen if part in sql}

    def position(self, part: str) -> int:
        return next(i for i, (sql, _) in enumerate(self.seen) if part in sql)


async def _open(tmp_path: Path) -> SqliteBackend:
    backend = await SqliteBackend.open(tmp_path / "store.db", "test store", foreign_keys=False)
    await backend.reader.execute("CREATE TABLE t (x INTEGER PRIMARY KEY)")
    await backend.reader.execute("CREATE TABLE previews (id TEXT, resolved_json TEXT)")
    return backend


def _rows(start: int, count: int) -> Iterator[tuple[int]]:
    return ((n,) for n in range(start, start + count))


def test_a_transaction_runs_its_statements_on_the_loop_and_only_waits_in_the_thread(
    tmp_path: Path,
) -> None:
    async def go() -> Traced:
        backend = await _open(tmp_path)
        try:
            traced = Traced(backend)
            async with backend.transaction() as db:
                await db.execute("INSERT INTO t (x) VALUES (?) -- one", (1,))
                rows = await db.execute_fetchall("SELECT x FROM t -- inside")
                assert [tuple(r) for r in rows] == [(1,)]
                await db.executemany("INSERT INTO t (x) VALUES (?) -- few", list(_rows(10, 3)))
                many = list(_rows(100, INLINE_ROWS + 1))
                await db.executemany("INSERT INTO t (x) VALUES (?) -- many", many)
                await db.executemany("INSERT INTO t (x) VALUES (?) -- generator", _rows(500, 2))
            count = await backend.reader.fetchone("SELECT COUNT(*) FROM t -- outside")
            assert count is not None and count[0] == 1 + 3 + INLINE_ROWS + 1 + 2
            return traced
        finally:
            await backend.close()

    traced = asyncio.run(go())
    assert traced.threads("BEGIN IMMEDIATE") == {LOOP}  # no other process held the lock
    assert traced.threads("COMMIT") == {WORKER}  # the fsync
    assert traced.threads("-- one") == {LOOP}
    assert traced.threads("-- inside") == {LOOP}
    assert traced.threads("-- few") == {LOOP}
    assert traced.threads("-- many") == {WORKER}  # more than INLINE_ROWS rows
    assert traced.threads("-- generator") == {WORKER}  # read where it runs: not on the loop
    assert traced.threads("-- outside") == {LOOP}  # a small read, within its bounds


def test_what_a_request_makes_large_stays_off_the_loop_inside_a_transaction(
    tmp_path: Path,
) -> None:
    """A statement whose size follows a request's (an 8 MiB JobSpec) runs in the thread, as
    every such step does (docs/security.md): bound values of more than INLINE_BYTES, and any
    read naming a column that can hold megabytes, whose answer cannot be sized beforehand."""
    assert "resolved_json" in LARGE_COLUMNS
    big = "x" * (INLINE_BYTES + 1)

    async def go() -> Traced:
        backend = await _open(tmp_path)
        try:
            traced = Traced(backend)
            async with backend.transaction() as db:
                await db.execute("INSERT INTO previews VALUES ('a', ?) -- small write", ("{}",))
                await db.execute("INSERT INTO previews VALUES ('b', ?) -- big write", (big,))
                await db.executemany(
                    "INSERT INTO previews VALUES (?, ?) -- big rows", [("c", big), ("d", "{}")]
                )
                await db.execute_fetchall("SELECT resolved_json FROM previews -- large read")
                await db.execute_fetchall("SELECT id FROM previews -- small read")
            return traced
        finally:
            await backend.close()

    traced = asyncio.run(go())
    assert traced.threads("-- small write") == {LOOP}
    assert traced.threads("-- big write") == {WORKER}
    assert traced.threads("-- big rows") == {WORKER}
    assert traced.threads("-- large read") == {WORKER}
    assert traced.threads("-- small read") == {LOOP}


@pytest.mark.parametrize(
    ("kind", "thread"), [(Store, LOOP), (TelemetryStore, WORKER), (LogStore, WORKER)]
)
def test_only_the_main_store_runs_its_transactions_statements_on_the_loop(
    tmp_path: Path, kind: type[StoreDb], thread: str
) -> None:
    """The telemetry and log stores' statements follow the points and bytes a request carries
    (a rollup over a series, log chunks): their work cannot be sized beforehand, so they stay
    in the thread."""

    async def go() -> Traced:
        store = await kind.open(tmp_path / "store.db")
        try:
            backend = store._backend
            assert isinstance(backend, SqliteBackend)
            traced = Traced(backend)
            async with store.transaction() as db:
                await db.execute_fetchall("SELECT 1 -- in a transaction")
            return traced
        finally:
            await store.close()

    assert asyncio.run(go()).threads("-- in a transaction") == {thread}


@pytest.mark.parametrize("reader_cancelled", [False, True], ids=["waiting", "cancelled"])
def test_a_statement_for_the_loop_waits_while_the_thread_holds_the_connection(
    tmp_path: Path, reader_cancelled: bool
) -> None:
    """A read outside the transaction holds the thread (its caller may even have given up on
    it): the transaction's next statement, and a small read the loop would run itself, go
    behind it instead of using the connection from a second thread at the same time."""

    async def go() -> Traced:
        backend = await _open(tmp_path)
        traced = Traced(backend)
        try:
            async with backend.transaction() as db:
                # Naming a column that can hold megabytes sends the read to the thread.
                reader = asyncio.create_task(
                    backend.reader.execute_fetchall("SELECT hold() AS resolved_json")
                )
                assert await asyncio.to_thread(traced.held.wait, 30)
                if reader_cancelled:
                    reader.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await reader
                insert = asyncio.create_task(db.execute("INSERT INTO t (x) VALUES (7)"))
                # A small read, which the loop runs itself when the connection is free.
                small = asyncio.create_task(backend.reader.execute_fetchall("SELECT 1 -- small"))
                await asyncio.sleep(0)  # one turn of the loop: a call run inline is done now
                assert not insert.done() and not small.done()
                assert not traced.threads("INSERT") and not traced.threads("-- small")
                traced.release.set()
                assert (await insert).rowcount == 1
                assert [tuple(r) for r in await small] == [(1,)]
                if not reader_cancelled:
                    assert [tuple(r) for r in await reader] == [(1,)]
            row = await backend.reader.fetchone("SELECT x FROM t")
            assert row is not None and row[0] == 7
            return traced
        finally:
            traced.release.set()
            await backend.close()

    traced = asyncio.run(go())
    assert traced.position("hold() ended") < traced.position("INSERT")
    assert traced.threads("INSERT") == {WORKER}
    assert traced.threads("-- small") == {WORKER}


_HOLDER = """\
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute(f"BEGIN {sys.argv[2]}")
db.execute("INSERT INTO t (x) VALUES (?)", (int(sys.argv[3]),))
print("held", flush=True)
sys.stdin.readline()
db.execute("COMMIT")
db.close()
"""


@asynccontextmanager
async def _held(path: Path, begin: str, value: int) -> AsyncIterator[Callable[[], Awaitable[None]]]:
    """Another process holding ``path`` in a ``BEGIN <begin>`` transaction that inserts
    ``value``. The block gets a call that commits it and waits for that process to end."""
    holder = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _HOLDER,
        str(path),
        begin,
        str(value),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        stdin, stdout = holder.stdin, holder.stdout
        assert stdin is not None and stdout is not None
        assert await stdout.readline() == b"held\n"

        async def release() -> None:
            stdin.write(b"commit\n")
            await stdin.drain()
            assert await holder.wait() == 0

        yield release
    finally:
        if holder.returncode is None:
            holder.kill()
            await holder.wait()


async def _waits_while_the_loop_turns(task: asyncio.Task[Any]) -> None:
    for _ in range(20):
        await asyncio.sleep(0)
    assert not task.done()


def test_a_transaction_waiting_for_another_process_lock_leaves_the_loop_running(
    tmp_path: Path,
) -> None:
    """Another process (an on-call's ``sqlite3``, the admin CLI) holds the file's write lock:
    this store's ``BEGIN IMMEDIATE``, refused at once on the loop (SQLite's busy wait off
    there), waits for it in the thread, and the loop goes on serving everything else meanwhile;
    the busy wait is back on afterwards."""

    async def go() -> tuple[Traced, list[int]]:
        backend = await _open(tmp_path)
        traced = Traced(backend)
        try:
            async with _held(tmp_path / "store.db", "IMMEDIATE", 1) as release:

                async def write() -> None:
                    async with backend.transaction() as db:
                        await db.execute("INSERT INTO t (x) VALUES (2)")

                writer = asyncio.create_task(write())
                await _waits_while_the_loop_turns(writer)
                await release()
                await writer
            rows = await backend.reader.execute_fetchall("SELECT x FROM t")
            return traced, [r[0] for r in rows]
        finally:
            await backend.close()

    traced, rows = asyncio.run(go())
    assert rows == [1, 2]
    assert traced.threads("BEGIN IMMEDIATE") == {LOOP, WORKER}  # refused, then waited for
    loop_side = [sql for sql, thread in traced.seen if thread == LOOP]
    assert loop_side[:3] == [
        "PRAGMA busy_timeout=0",
        "BEGIN IMMEDIATE",
        f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}",
    ]


def test_a_read_outside_a_transaction_runs_on_the_loop_unless_sqlite_would_wait(
    tmp_path: Path,
) -> None:
    """A small read outside a transaction (a credential, a Fleet's settings) runs on the loop
    with SQLite's busy wait off. When another process holds a lock the read needs,
    SQLite refuses it at once there; it then waits for the lock in the thread, with the wait
    back on, while the loop goes on. (A store in WAL mode hardly ever makes a reader wait, so
    the lock is held on a second file in rollback-journal mode, attached to the connection.)"""
    other = tmp_path / "other.db"
    with closing(sqlite3.connect(other)) as db:
        db.execute("CREATE TABLE t (x INTEGER PRIMARY KEY)")

    async def go() -> tuple[Traced, list[int]]:
        backend = await _open(tmp_path)
        traced = Traced(backend)
        try:
            await backend.reader.execute("ATTACH DATABASE ? AS other", (str(other),))
            await backend.reader.execute_fetchall("SELECT x FROM other.t -- free")
            async with _held(other, "EXCLUSIVE", 3) as release:
                reader = asyncio.create_task(
                    backend.reader.execute_fetchall("SELECT x FROM other.t -- held")
                )
                await _waits_while_the_loop_turns(reader)
                await release()
                return traced, [r[0] for r in await reader]
        finally:
            await backend.close()

    traced, rows = asyncio.run(go())
    assert traced.threads("-- free") == {LOOP}
    assert traced.threads("-- held") == {LOOP, WORKER}  # refused at once, then waited for
    # On the loop the read ran with the busy wait off, and the wait was put back after it.
    loop_side = [sql for sql, thread in traced.seen if thread == LOOP]
    held = loop_side.index(next(sql for sql in loop_side if "-- held" in sql))
    assert loop_side[held - 1] == "PRAGMA busy_timeout=0"
    assert loop_side[held + 1] == f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}"
    assert rows == [3]


class Ticks:
    """The connection's progress handler as a test sets it
    (:meth:`SqliteLink.set_progress_handler`): which thread SQLite called it on, once every
    ``GRAIN`` instructions."""

    GRAIN = 100

    def __init__(self) -> None:
        self.threads: list[str] = []

    def __call__(self) -> int:
        self.threads.append(threading.current_thread().name)
        return 0  # go on


#: A read of one row that costs SQLite far more instructions than a read on the loop may.
LONG_READ = (
    "SELECT (WITH RECURSIVE c(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM c WHERE n < 100000) "
    "SELECT COUNT(*) FROM c) -- long"
)


def test_a_read_past_its_bounds_on_the_loop_is_dropped_there_and_read_whole_in_the_thread(
    tmp_path: Path,
) -> None:
    """A read outside a transaction that goes past INLINE_READ_OPS of SQLite's instructions
    (one row, from a long walk) or INLINE_ROWS rows is stopped on the loop at that bound and
    read again in the thread, whole; the progress handler a test set stays the connection's."""
    ticks = Ticks()

    async def go() -> tuple[Traced, int, list[int], list[str]]:
        backend = await _open(tmp_path)
        traced = Traced(backend)
        try:
            backend._link.set_progress_handler(ticks, Ticks.GRAIN)
            [count] = await backend.reader.execute_fetchall(LONG_READ)
            long_read = list(ticks.threads)
            async with backend.transaction() as db:
                await db.executemany("INSERT INTO t (x) VALUES (?)", list(_rows(0, INLINE_ROWS)))
            few = await backend.reader.execute_fetchall("SELECT x FROM t -- few rows")
            async with backend.transaction() as db:
                await db.execute("INSERT INTO t (x) VALUES (?)", (INLINE_ROWS,))
            many = await backend.reader.execute_fetchall("SELECT x FROM t -- many rows")
            assert len(few) == INLINE_ROWS
            return traced, count[0], [r[0] for r in many], long_read
        finally:
            await backend.close()

    traced, count, many, long_read = asyncio.run(go())
    assert count == 100_000
    assert traced.threads("-- long") == {LOOP, WORKER}
    # On the loop SQLite was stopped at the bound; the thread walked the rest.
    on_loop = long_read.count(LOOP)
    assert INLINE_READ_OPS // Ticks.GRAIN <= on_loop <= INLINE_READ_OPS // Ticks.GRAIN + 1
    assert long_read.count(WORKER) > 10 * on_loop
    assert len(ticks.threads) > len(long_read)  # still the connection's handler afterwards
    assert traced.threads("-- few rows") == {LOOP}
    assert traced.threads("-- many rows") == {LOOP, WORKER}
    assert many == list(range(INLINE_ROWS + 1))


def test_a_read_stopped_on_the_loop_leaves_an_open_transaction_as_it_was(tmp_path: Path) -> None:
    """The store has one connection: a read outside a transaction that runs while another
    task's transaction is open, and is stopped at its bound, must not end that transaction
    (SQLite rolls back a whole transaction only for an interrupted write)."""

    async def go() -> list[int]:
        backend = await _open(tmp_path)
        try:
            async with backend.transaction() as db:
                await db.execute("INSERT INTO t (x) VALUES (1)")
                [count] = await backend.reader.execute_fetchall(LONG_READ)
                assert count[0] == 100_000
                assert backend._link.conn.in_transaction
                await db.execute("INSERT INTO t (x) VALUES (2)")
            return [r[0] for r in await backend.reader.execute_fetchall("SELECT x FROM t")]
        finally:
            await backend.close()

    assert asyncio.run(go()) == [1, 2]


def test_a_read_that_may_write_never_runs_on_the_loop_outside_a_transaction(
    tmp_path: Path,
) -> None:
    """Outside a transaction a statement commits on its own, with an fsync: only a ``SELECT``
    is tried on the loop, never a ``RETURNING`` write or a pragma read through the same call."""

    async def go() -> Traced:
        backend = await _open(tmp_path)
        traced = Traced(backend)
        try:
            await backend.reader.execute_fetchall(
                "INSERT INTO t (x) VALUES (5) RETURNING x -- returning"
            )
            await backend.reader.execute_fetchall("PRAGMA user_version -- pragma")
            await backend.reader.execute_fetchall("  select x from t -- lower case select")
            return traced
        finally:
            await backend.close()

    traced = asyncio.run(go())
    assert traced.threads("-- returning") == {WORKER}
    assert traced.threads("-- pragma") == {WORKER}
    assert traced.threads("-- lower case select") == {LOOP}
