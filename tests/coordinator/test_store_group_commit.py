"""Group commit in the SQLite store (coordinator/store/sqlite_group.py).

Write blocks queued behind one another share one ``COMMIT``, each in a savepoint; a writer hears
of its block only once that ``COMMIT`` returned. Every test reads the outcome from a connection
of its own, which sees only what was committed, and SQLite's trace callback counts the
``COMMIT`` s. Blocks queue up the way they do in the coordinator: the first one's statement
goes to the worker thread (a batch read where it runs), and the writers started meanwhile wait
for the lock.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from contextlib import closing
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from tuneplane.coordinator.store.handle import Handle, StoreUnavailable
from tuneplane.coordinator.store.sqlite import SqliteBackend
from tuneplane.coordinator.store.sqlite_group import MAX_MEMBERS

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.sqlite_only("its subject is the SQLite backend's group commit"),
]


async def _open(path: Path) -> tuple[SqliteBackend, list[str]]:
    backend = await SqliteBackend.open(path, "test store", foreign_keys=False)
    await backend.reader.execute("CREATE TABLE t (x INTEGER PRIMARY KEY, v BLOB)")
    statements: list[str] = []
    backend._link.conn.set_trace_callback(statements.append)  # set while its thread idles
    return backend, statements


def _committed(path: Path) -> list[int]:
    """The rows another connection sees: only what was committed."""
    with closing(sqlite3.connect(path)) as conn:
        return [int(r[0]) for r in conn.execute("SELECT x FROM t ORDER BY x")]


def _numbers(*xs: int) -> Iterator[tuple[int]]:
    return ((x,) for x in xs)


async def _queue_behind(db: Handle, x: int) -> None:
    """Insert ``x`` through the worker thread (a generator is read where it runs), so the
    writers started meanwhile queue up for the lock."""
    await db.executemany("INSERT INTO t (x) VALUES (?)", _numbers(x))


def _writer(
    backend: SqliteBackend, path: Path, x: int, heard: list[int], first: bool = False
) -> Callable[[], Awaitable[None]]:
    async def write() -> None:
        async with backend.transaction() as db:
            if first:
                await _queue_behind(db, x)
            else:
                await db.execute("INSERT INTO t (x) VALUES (?)", (x,))
        # Heard: it must be committed already, as another connection sees it.
        assert x in _committed(path)
        heard.append(x)

    return write


def _commits(statements: list[str]) -> list[int]:
    """How many blocks each COMMIT closed (savepoints opened since the last one)."""
    sizes, blocks = [], 0
    for sql in statements:
        if sql.startswith("SAVEPOINT"):
            blocks += 1
        elif sql == "COMMIT":
            sizes.append(blocks)
            blocks = 0
    return sizes


def test_writers_queued_behind_one_another_share_one_commit_and_hear_once_it_is_on_disk(
    tmp_path: Path,
) -> None:
    path = tmp_path / "store.db"

    async def go() -> tuple[list[int], list[str], tuple[int, int]]:
        backend, statements = await _open(path)
        heard: list[int] = []
        try:
            writers = [_writer(backend, path, x, heard, first=x == 0) for x in range(8)]
            await asyncio.gather(*(w() for w in writers))
            return heard, statements, (backend.groups.committed_blocks, backend.groups.commits)
        finally:
            await backend.close()

    heard, statements, (blocks, commits) = asyncio.run(go())
    assert sorted(heard) == list(range(8))
    assert _committed(path) == list(range(8))
    # The first block's COMMIT held all seven that queued behind it.
    assert _commits(statements) == [8]
    assert (blocks, commits) == (8, 1)


def test_a_lone_writer_commits_at_once(tmp_path: Path) -> None:
    path = tmp_path / "store.db"

    async def go() -> list[str]:
        backend, statements = await _open(path)
        heard: list[int] = []
        try:
            for x in range(3):
                await _writer(backend, path, x, heard)()
            return statements
        finally:
            await backend.close()

    statements = asyncio.run(go())
    assert _commits(statements) == [1, 1, 1]


def test_a_failed_block_leaves_nothing_and_the_others_in_its_group_commit(tmp_path: Path) -> None:
    path = tmp_path / "store.db"

    async def go() -> tuple[list[int], BaseException | None, list[str]]:
        backend, statements = await _open(path)
        heard: list[int] = []

        async def failing() -> None:
            async with backend.transaction() as db:
                await db.execute("INSERT INTO t (x) VALUES (?)", (1,))
                raise ValueError("the block's own error")

        try:
            results = await asyncio.gather(
                _writer(backend, path, 0, heard, first=True)(),
                failing(),
                _writer(backend, path, 2, heard)(),
                return_exceptions=True,
            )
            error = results[1] if isinstance(results[1], BaseException) else None
            return heard, error, statements
        finally:
            await backend.close()

    heard, error, statements = asyncio.run(go())
    assert isinstance(error, ValueError)
    assert sorted(heard) == [0, 2]
    assert _committed(path) == [0, 2]
    assert _commits(statements) == [3]  # one COMMIT; the failed block's savepoint taken back


def test_a_group_commits_at_most_max_members_blocks(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    count = 2 * MAX_MEMBERS + 3

    async def go() -> list[str]:
        backend, statements = await _open(path)
        heard: list[int] = []
        try:
            writers = [_writer(backend, path, x, heard, first=x == 0) for x in range(count)]
            await asyncio.gather(*(w() for w in writers))
            return statements
        finally:
            await backend.close()

    statements = asyncio.run(go())
    sizes = _commits(statements)
    assert sum(sizes) == count and max(sizes) == MAX_MEMBERS
    assert _committed(path) == list(range(count))


def test_a_writer_cancelled_while_it_waits_leaves_the_group_to_commit(tmp_path: Path) -> None:
    path = tmp_path / "store.db"

    async def go() -> tuple[list[int], bool]:
        backend, _ = await _open(path)
        heard: list[int] = []
        waiting: list[asyncio.Task[None]] = []

        async def first() -> None:
            async with backend.transaction() as db:
                await _queue_behind(db, 0)
                waiting[0].cancel()  # it waits for the lock now: it will never run its block
            assert 0 in _committed(path)
            heard.append(0)

        try:
            task = asyncio.ensure_future(first())
            waiting.append(asyncio.ensure_future(_writer(backend, path, 1, heard)()))
            await task  # hangs (the test's timeout) if nobody commits the group
            await asyncio.gather(waiting[0], return_exceptions=True)
            return heard, waiting[0].cancelled()
        finally:
            await backend.close()

    heard, cancelled = asyncio.run(go())
    assert heard == [0] and cancelled
    assert _committed(path) == [0]


def test_a_block_cancelled_under_a_cancel_scope_is_taken_back_and_its_group_commits(
    tmp_path: Path,
) -> None:
    """A cancel scope cancels its writer again at every await, including the ones that take its
    block back: the others of its group must still commit and hear, and the cancelled block
    leave nothing."""
    path = tmp_path / "store.db"

    async def go() -> tuple[list[int], bool]:
        backend, _ = await _open(path)
        heard: list[int] = []
        cancelled = False

        async def cancelled_inside() -> None:
            nonlocal cancelled
            with anyio.CancelScope() as scope:
                async with backend.transaction() as db:
                    await db.execute("INSERT INTO t (x) VALUES (?)", (1,))
                    scope.cancel()
                    await anyio.lowlevel.checkpoint()
            cancelled = scope.cancelled_caught

        try:
            await asyncio.gather(
                _writer(backend, path, 0, heard, first=True)(),
                cancelled_inside(),
                _writer(backend, path, 2, heard)(),
            )
            return heard, cancelled
        finally:
            await backend.close()

    heard, cancelled = anyio.run(go, backend="asyncio")
    assert cancelled and sorted(heard) == [0, 2]
    assert _committed(path) == [0, 2]


def test_a_full_store_that_sqlite_rolls_back_whole_fails_every_block_of_the_group(
    tmp_path: Path,
) -> None:
    """SQLite answers a full database (here its page limit) by rolling back the whole
    transaction: the block before the one that filled it was not kept, so it must not be heard
    as kept; the writer queued after them starts a group of its own and commits."""
    path = tmp_path / "store.db"

    async def go() -> list[BaseException | None]:
        backend, _ = await _open(path)
        heard: list[int] = []
        backend._link.conn.execute("PRAGMA max_page_count=30").close()

        async def filling() -> None:
            async with backend.transaction() as db:
                await db.execute("INSERT INTO t (x, v) VALUES (1, zeroblob(1000000))")

        try:
            return list(
                await asyncio.gather(
                    _writer(backend, path, 0, heard, first=True)(),
                    filling(),
                    _writer(backend, path, 2, heard)(),
                    return_exceptions=True,
                )
            )
        finally:
            await backend.close()

    first, filling, last = asyncio.run(go())
    assert isinstance(first, StoreUnavailable)
    assert "none of them was kept" in str(first) and "test store" in str(first)
    assert isinstance(filling, sqlite3.OperationalError) and "full" in str(filling)
    assert last is None
    assert _committed(path) == [2]


_CHILD = """
import asyncio, sys
from pathlib import Path
from tuneplane.coordinator.store.sqlite import SqliteBackend

async def main(path):
    backend = await SqliteBackend.open(Path(path), "test store", foreign_keys=False)
    await backend.reader.execute("CREATE TABLE t (x INTEGER PRIMARY KEY, v BLOB)")

    async def write(x):
        async with backend.transaction() as db:
            if x % 8 == 0:  # through the thread: the next writers queue behind it
                await db.executemany("INSERT INTO t (x) VALUES (?)", ((x,) for _ in [0]))
            else:
                await db.execute("INSERT INTO t (x) VALUES (?)", (x,))
        sys.stdout.write(f"{x}\\n")
        sys.stdout.flush()

    x = 0
    while True:
        await asyncio.gather(*(write(x + i) for i in range(8)))
        x += 8

asyncio.run(main(sys.argv[1]))
"""


def test_every_write_a_killed_process_acknowledged_is_in_the_file(tmp_path: Path) -> None:
    """kill -9 in the middle of grouped writes: each acknowledged one was committed."""
    path = tmp_path / "store.db"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(path)], stdout=subprocess.PIPE, text=True
    )
    acknowledged: list[int] = []
    try:
        assert child.stdout is not None
        for line in child.stdout:
            acknowledged.append(int(line))
            if len(acknowledged) == 500:
                os.kill(child.pid, signal.SIGKILL)
                break
    finally:
        child.kill()
        child.wait()
    assert len(acknowledged) == 500
    kept = set(_committed(path))
    assert set(acknowledged) <= kept
