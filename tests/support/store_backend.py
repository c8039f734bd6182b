"""Which store backend a test runs on, and reading, writing or locking a store from outside the
coordinator, the way an operator's ``sqlite3`` or ``psql`` would.

Rules: tests/coordinator/conftest.py runs every test there once per backend and makes that
backend :func:`current` for the test; everything else in tests/support that starts a coordinator
or opens a store asks :func:`current` (SQLite unless a test says otherwise). A PostgreSQL
backend makes its database only when a test first needs one, and drops every database it made
when the test ends. Reads and writes here go around the coordinator on a connection of their
own, on both backends: ``?`` SQL, rows as tuples.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any, TypeVar, cast

from tests.support.postgres import PostgresServer, run_async
from tuneplane.coordinator.config import CONFIG_NAME, store_setting
from tuneplane.coordinator.store.core import Store
from tuneplane.coordinator.store.db import StoreDb
from tuneplane.coordinator.store.fence import LEASE_SCHEMA
from tuneplane.coordinator.store.logs import DB_NAME as LOGS_DB
from tuneplane.coordinator.store.logs import LogStore
from tuneplane.coordinator.store.postgres import write_lock_key
from tuneplane.coordinator.store.sql import to_postgres
from tuneplane.coordinator.store.telemetry import DB_NAME as TELEMETRY_DB
from tuneplane.coordinator.store.telemetry import TelemetryStore
from tuneplane.coordinator.store_location import PostgresUrl, Where, parse_store_url, store_where

S = TypeVar("S", bound=StoreDb)
#: Each store class and its SQLite file in a state directory.
FILES: dict[type[StoreDb], str] = {
    Store: "coordinator.db",
    TelemetryStore: TELEMETRY_DB,
    LogStore: LOGS_DB,
}


class StoreBackend:
    """``sqlite`` (files where the test says) or ``postgresql`` (databases on the session's
    server, made on first use)."""

    def __init__(self, name: str, server: PostgresServer | None = None) -> None:
        self.name = name
        self._server = server
        self._databases: list[str] = []

    @property
    def is_postgres(self) -> bool:
        return self._server is not None

    def url(self) -> str:
        """This test's database (made now if it has none yet); "" on SQLite."""
        if self._server is None:
            return ""
        if not self._databases:
            self._databases.append(self._server.create_database())
        return self._server.url(self._databases[0])

    def sibling(self) -> StoreBackend:
        """A backend of the same kind with databases of its own (on the same server): the
        store of a second, unrelated coordinator in the same test module."""
        return StoreBackend(self.name, self._server)

    def emptied_url(self) -> str:
        """This test's database with every store's schema dropped (PostgreSQL only): empty for
        the next store, as a new temporary folder is on SQLite. No store may be open there."""
        assert self._server is not None, "a SQLite backend has no databases"
        url = self.url()
        # The leader lease's schema too: a store made fresh has never had a leader.
        schemas = ", ".join(f'"{s}"' for s in (*(cls.SCHEMA for cls in FILES), LEASE_SCHEMA))
        self._server.execute(f"DROP SCHEMA IF EXISTS {schemas} CASCADE", self._databases[0])
        return url

    def where(self, path: Path, fresh: bool = False) -> Where:
        """Where a store the test opens itself lives: ``path`` on SQLite, else this test's
        database (emptied first with ``fresh``, for a test that opens one store after another
        in new folders, as a hypothesis test does per example)."""
        if self._server is None:
            return path
        return parse_store_url(self.emptied_url() if fresh else self.url(), "the test database")

    def init_args(self) -> list[str]:
        """What ``tuneplane-coordinator init`` adds: ``--store URL`` on PostgreSQL."""
        return ["--store", self.url()] if self._server is not None else []

    def close(self) -> None:
        """Drop every database this test made."""
        if self._server is not None:
            for name in self._databases:
                self._server.drop_database(name)
        self._databases.clear()


SQLITE = StoreBackend("sqlite")
_current: list[StoreBackend] = [SQLITE]


def current() -> StoreBackend:
    """The backend the running test uses (SQLite outside tests/coordinator)."""
    return _current[-1]


@contextmanager
def in_use(backend: StoreBackend) -> Iterator[StoreBackend]:
    """Make ``backend`` :func:`current` for the block; its databases are dropped after."""
    _current.append(backend)
    try:
        yield backend
    finally:
        _current.pop()
        backend.close()


def where_in(state_dir: Path, cls: type[StoreDb] = Store) -> Where:
    """Where the coordinator initialised in ``state_dir`` keeps the store ``cls``; for a folder
    no ``init`` made (a test that opened the store there itself), where the test's backend
    puts it."""
    if not (state_dir / CONFIG_NAME).exists():
        return current().where(state_dir / FILES[cls])
    return store_where(state_dir, store_setting(state_dir), FILES[cls])


def read(
    where: Where, cls: type[StoreDb], sql: str, args: Sequence[Any] = ()
) -> list[tuple[Any, ...]]:
    """The rows of ``sql`` from the store ``cls`` at ``where``, read on a connection of its own
    (SQLite read-only)."""
    if isinstance(where, PostgresUrl):
        return [tuple(r) for r in _postgres(where, cls, sql, args, fetch=True)]
    with closing(sqlite3.connect(f"file:{where}?mode=ro", uri=True, timeout=10)) as db:
        return [tuple(r) for r in db.execute(sql, tuple(args)).fetchall()]


def write(where: Where, cls: type[StoreDb], sql: str, args: Sequence[Any] = ()) -> None:
    """Run one statement against the store ``cls`` at ``where``, committed at once."""
    if isinstance(where, PostgresUrl):
        _postgres(where, cls, sql, args, fetch=False)
        return
    with closing(sqlite3.connect(where, timeout=10, isolation_level=None)) as db:
        db.execute(sql, tuple(args))


def _postgres(
    url: PostgresUrl, cls: type[StoreDb], sql: str, args: Sequence[Any], fetch: bool
) -> list[Any]:
    import asyncpg

    async def go() -> list[Any]:
        db = await asyncpg.connect(url.dsn(), server_settings={"search_path": cls.SCHEMA})
        try:
            if fetch:
                return list(await db.fetch(to_postgres(sql), *args))
            await db.execute(to_postgres(sql), *args)
            return []
        finally:
            await db.close()

    return run_async(go)


@contextmanager
def write_lock(where: Where, cls: type[StoreDb] = Store) -> Iterator[None]:
    """Hold the store's write lock from another connection for the block, as a long manual
    session would: SQLite's ``BEGIN IMMEDIATE``, or the store's advisory lock on PostgreSQL.
    Every write of the coordinator waits meanwhile."""
    if not isinstance(where, PostgresUrl):
        lock = sqlite3.connect(where, timeout=10, isolation_level=None)
        try:
            lock.execute("BEGIN IMMEDIATE")
            yield
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        return
    import asyncpg

    held = threading.Event()
    release = threading.Event()
    failed: list[BaseException] = []

    async def hold() -> None:
        db = await asyncpg.connect(where.dsn())
        try:
            await db.execute("SELECT pg_advisory_lock($1)", write_lock_key(cls.SCHEMA))
            held.set()
            await asyncio.to_thread(release.wait)
            await db.execute("SELECT pg_advisory_unlock($1)", write_lock_key(cls.SCHEMA))
        finally:
            await db.close()

    def run() -> None:
        try:
            asyncio.run(hold())
        except BaseException as exc:
            failed.append(exc)
            held.set()

    thread = threading.Thread(target=run, name="tests-store-lock")
    thread.start()
    held.wait(30)
    try:
        if failed:
            raise failed[0]
        yield
    finally:
        release.set()
        thread.join(30)


async def open_at_version(cls: type[S], where: Where, version: int) -> S:
    """The store ``cls`` at ``where``, migrated only up to ``version``: what an older
    coordinator left behind, for a migration test on either backend."""
    migrations = tuple(m for m in cls.MIGRATIONS if m[0] <= version)
    older = cast(type[S], type(cls.__name__, (cls,), {"MIGRATIONS": migrations}))
    return await older.open(where)
