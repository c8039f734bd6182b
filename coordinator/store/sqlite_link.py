"""The SQLite store's one connection and the one worker thread that runs its slow calls
(coordinator/store/sqlite.py says which calls those are): a call handed to the thread, a call
run on the event loop while the connection is free, and a read or a ``BEGIN`` tried there with
SQLite's busy wait off and a read's bounds.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from typing import Any, Generic, TypeVar, cast

import attrs

from .handle import IntegrityViolation, Row, StoreUnavailable, integrity_sentence

BUSY_TIMEOUT_MS = 10_000
#: The most rows an ``executemany`` inside a transaction writes on the event loop (a larger
#: batch, a Hello storm or a copied table, goes to the worker thread), and a read returns there.
INLINE_ROWS = 64
#: The most virtual-machine instructions a read outside a transaction runs on the event loop
#: (a fraction of a millisecond); past them SQLite interrupts it and it runs in the thread.
INLINE_READ_OPS = 20_000
#: Instructions between two calls of the connection's progress handler.
PROGRESS_GRAIN = 1_000
T = TypeVar("T")


class SqliteLink:
    """The store's one :class:`sqlite3.Connection` and the one worker thread that runs its
    slow calls, in the order they came.

    :meth:`threaded` queues a call for that thread. :meth:`inline` runs one on the event loop
    when nothing is queued or running there, else queues it behind the rest: the connection is
    never used by two threads at once, and one caller's calls keep their order.

    The thread is this class's own rather than an executor's: a call handed to it is one queue
    put and one wake-up of the loop, and the thread reads the queue again at once when
    several are waiting.
    """

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self._calls: queue.SimpleQueue[_Call[Any] | None] = queue.SimpleQueue()
        # Each counter has one writer (the loop, the worker thread), so neither needs a lock.
        self._queued = 0
        self._done = 0
        self._observer: tuple[Callable[[], int], int] | None = None
        self._thread = threading.Thread(target=self._serve, name="store-sqlite", daemon=True)
        self._thread.start()

    async def threaded(self, call: Callable[[], T]) -> T:
        # A cancelled caller leaves the call to run: the count says when the thread is done.
        return await self.submit(call)

    def submit(self, call: Callable[[], T]) -> asyncio.Future[T]:
        """Queue ``call`` for the thread, after every call queued before it: its outcome."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._queued += 1
        self._calls.put(_Call(call, future, loop))
        return future

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            outcome = item.outcome()
            # Counted before the caller hears: by then the connection is free for the loop.
            self._done += 1
            item.deliver(*outcome)
            del item, outcome  # keep nothing of a call alive while waiting for the next

    @property
    def idle(self) -> bool:
        """Whether nothing is queued for the thread or running there: the connection is the
        loop's to use now."""
        return self._done == self._queued

    async def inline(self, call: Callable[[], T]) -> T:
        if self.idle:
            return call()
        return await self.threaded(call)

    def set_progress_handler(self, handler: Callable[[], int] | None, grain: int) -> None:
        """The connection's progress handler (a test counts instructions): read_bounded's too."""
        self._observer = None if handler is None else (handler, grain)
        self.conn.set_progress_handler(handler, grain)

    def unwaiting(self, call: Callable[[], T]) -> T | None:
        """``call`` here with SQLite's busy wait off; None, without running it, while the thread
        has the connection, and None where SQLite would have waited for another process's lock
        or stopped a read at its bound."""
        if not self.idle:
            return None
        read_rows(self.conn.execute("PRAGMA busy_timeout=0"))
        try:
            return call()
        except sqlite3.OperationalError as exc:
            if "interrupted" in str(exc) or waits(exc):
                return None
            raise
        finally:
            read_rows(self.conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}"))

    def read_bounded(self, sql: str, values: tuple[Any, ...]) -> list[Row] | None:
        """``sql``'s rows read within the module's bounds (:meth:`unwaiting`); None past one."""
        observer, grain = self._observer or (None, PROGRESS_GRAIN)
        calls, limit = itertools.count(1), max(1, INLINE_READ_OPS // grain)

        def progress() -> int:  # non-zero: SQLite interrupts the statement
            if observer is not None:
                observer()
            return int(next(calls) > limit)

        def read() -> list[Row] | None:
            self.conn.set_progress_handler(progress, grain)
            try:
                with closing(self.conn.execute(sql, values)) as cursor:
                    rows = cursor.fetchmany(INLINE_ROWS + 1)
            finally:
                self.conn.set_progress_handler(observer, grain)
            return rows if len(rows) <= INLINE_ROWS else None

        return self.unwaiting(read)

    async def close(self) -> None:
        await self.threaded(self.conn.close)
        self._calls.put(None)


@attrs.frozen
class _Call(Generic[T]):
    """One call for the worker thread and the future on the loop that gets its outcome."""

    call: Callable[[], T]
    future: asyncio.Future[T]
    loop: asyncio.AbstractEventLoop

    def outcome(self) -> tuple[T | None, BaseException | None]:
        try:
            return self.call(), None
        except BaseException as exc:  # handed to the caller on the loop, raised there
            return None, exc

    def deliver(self, result: T | None, error: BaseException | None) -> None:
        if not self.loop.is_closed():  # a closed loop has nobody left to tell
            self.loop.call_soon_threadsafe(_settle, self.future, result, error)


def _settle(future: asyncio.Future[T], result: T | None, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(cast(T, result))


@contextmanager
def mapped_errors(what: str) -> Iterator[None]:
    """SQLite's errors as the store's: a broken constraint, a lock still held past the busy
    wait. ``what``: the store and its file, for the message."""
    try:
        yield
    except sqlite3.IntegrityError as exc:
        raise IntegrityViolation(integrity_sentence(what, str(exc))) from exc
    except sqlite3.OperationalError as exc:
        if not waits(exc):
            raise
        raise StoreUnavailable(
            f"the {what} stayed locked by another process for "
            f"{BUSY_TIMEOUT_MS // 1000} s ({exc}); nothing was changed. Find the process "
            "holding it (a long `sqlite3` session?), end it, and try again."
        ) from exc


def waits(exc: sqlite3.OperationalError) -> bool:
    """Whether SQLite refused because another connection holds a lock it would wait for."""
    return "locked" in str(exc) or "busy" in str(exc)


def read_rows(cursor: sqlite3.Cursor) -> list[Row]:
    with closing(cursor):
        return list(cursor.fetchall())
