"""What every coordinator store shares, on SQLite or PostgreSQL: migrations, one writer at a
time, transactions a deadline cannot cut in half, and re-runs of the ones a conflict aborted.

Rules:
- A store opens at a :data:`~tuneplane.coordinator.store_location.Where`: a SQLite file
  (:mod:`store_sqlite`) or a PostgreSQL database, where each store class keeps its tables in
  its own schema (:attr:`StoreDb.SCHEMA`; :mod:`store_postgres`). Store code never sees which:
  it writes ``?`` SQL against a :class:`~tuneplane.coordinator.store.handle.Handle`, from
  :meth:`StoreDb.transaction` for writes and :attr:`StoreDb.reader` for reads.
- A write is a zero-argument async callable run by :meth:`StoreDb.shielded`: one transaction
  (``async with self.transaction() as db``), one at a time in this process, serialised across
  processes by the backend (on SQLite, blocks queued behind one another share one ``COMMIT``:
  :mod:`.sqlite_group`), and acknowledged only once on disk. It runs to the end even when the
  caller's deadline passes, and :meth:`StoreDb.close` waits for it. When the database aborts it
  to resolve a conflict (serialisation failure, deadlock) it is run again whole, at most
  :data:`MAX_ATTEMPTS` times: each re-run is a :class:`StoreRetry`, logged and handed to the
  store's retry observers (``serve`` counts them in its Prometheus registry).
- Store code names what a transaction changed with :meth:`StoreDb.changed` (a Job's run id);
  the names go to the store's commit observers only once that transaction committed (never for
  one rolled back), so whoever is woken by them and reads sees the change (WatchJob).
- Migrations are numbered and applied in order at open, each in its own transaction that reads
  the version again first, so two processes opening one database apply each exactly once. A
  database newer than this code is refused rather than guessed at.
- Copying a store (to move it between backends) needs only :meth:`StoreDb.tables` (dependency
  order), :meth:`StoreDb.columns`, :meth:`StoreDb.read_rows` and :meth:`StoreDb.insert_rows`;
  a whole store, from one snapshot into one transaction, :meth:`StoreDb.read_snapshot` and
  :meth:`StoreDb.loading` (``migrate-store``).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any, ClassVar, Protocol, Self, TypeVar

import attrs

from ..store_location import PostgresUrl, Where
from .handle import (
    Handle,
    Row,
    SchemaTooNew,
    SnapshotReader,
    StoreError,
    StoreUnavailable,
    TransactionConflict,
)
from .sqlite import SqliteBackend

log = logging.getLogger(__name__)

T = TypeVar("T")
Migrations = tuple[tuple[int, tuple[str, ...]], ...]
#: How many times one write runs before a conflict that keeps coming back is given up on.
MAX_ATTEMPTS = 5
COPY_BATCH = 1000
#: What the transaction running in this task changed so far (:meth:`StoreDb.changed`); None
#: outside a transaction.
_changed: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar(
    "store_changed", default=None
)


@attrs.frozen
class StoreRetry:
    """A write transaction the database aborted, about to run again.

    ``store``: the store's :attr:`StoreDb.LABEL`. ``reason``: ``serialization`` or
    ``deadlock``. ``attempt``: the attempt that failed (1 for the first run).
    """

    store: str
    reason: str
    attempt: int


class Backend(Protocol):
    """What :mod:`store_sqlite` and :mod:`store_postgres` each provide."""

    reader: Handle

    async def close(self) -> None: ...

    async def abandon(self) -> None: ...

    def transaction(self) -> AbstractAsyncContextManager[Handle]: ...

    def migration_sql(self, sql: str) -> str: ...

    async def prepare_home(self, db: Handle) -> None: ...

    async def table_facts(self) -> tuple[list[str], list[tuple[str, str]]]: ...

    async def columns(self, table: str) -> list[str]: ...

    async def after_insert(self, db: Handle, table: str) -> None: ...

    async def snapshot(self, work: Callable[[SnapshotReader], T]) -> T: ...

    def batches(self, sql: str, size: int) -> AsyncIterator[list[Row]]: ...


def dependency_order(tables: Iterable[str], references: Iterable[tuple[str, str]]) -> list[str]:
    """``tables`` ordered so each comes after every table it references (then by name)."""
    names = sorted(set(tables))
    needs = {t: {r for s, r in references if s == t and r != t and r in names} for t in names}
    ordered: list[str] = []
    while needs:
        ready = sorted(t for t, n in needs.items() if not n - set(ordered))
        if not ready:  # a cycle: the rest by name, which a copy without constraints tolerates
            ready = sorted(needs)
        for t in ready:
            ordered.append(t)
            del needs[t]
    return ordered


class StoreDb:
    """Base of one store. Open with :meth:`open`; close with :meth:`close`."""

    #: What the store is called in messages and logs ("store", "log store", ...).
    LABEL: ClassVar[str]
    #: The one-row table holding this store's schema version.
    VERSION_TABLE: ClassVar[str]
    #: The PostgreSQL schema holding this store's tables.
    SCHEMA: ClassVar[str]
    MIGRATIONS: ClassVar[Migrations]
    FOREIGN_KEYS: ClassVar[bool] = False
    #: On SQLite, whether a write transaction's statements run on the event loop (see
    #: :mod:`.sqlite`): for a store whose statements touch a Job's or a Node's few rows. A store
    #: whose statements follow the points or bytes a request carries (rollups over a series, log
    #: chunks) keeps them in the worker thread, since their work cannot be sized beforehand.
    STATEMENTS_ON_LOOP: ClassVar[bool] = False

    def __init__(self, backend: Backend, where: Where) -> None:
        self._backend = backend
        self.reader: Handle = backend.reader
        self.where = where
        self._inflight: set[asyncio.Task[Any]] = set()
        #: Called with each :class:`StoreRetry` (serve counts them for Prometheus).
        self.retry_observers: list[Callable[[StoreRetry], None]] = []
        #: Called with what each transaction changed (:meth:`changed`), after it committed.
        self.commit_observers: list[Callable[[frozenset[str]], None]] = []

    @classmethod
    async def open(cls, where: Where) -> Self:
        """Open (creating and migrating as needed) the store at ``where``."""
        backend: Backend
        if isinstance(where, PostgresUrl):
            # Imported here: a coordinator on SQLite (and every admin command) never loads the
            # PostgreSQL driver.
            from .postgres import PostgresBackend

            backend = await PostgresBackend.open(where, cls.SCHEMA, cls.LABEL)
        else:
            backend = await SqliteBackend.open(
                Path(where), f"{cls.LABEL} {where}", cls.FOREIGN_KEYS, cls.STATEMENTS_ON_LOOP
            )
        store = cls(backend, where)
        try:
            await store._migrate()
        except BaseException:
            await backend.close()
            raise
        return store

    def fence(self, term: int, on_fenced: Callable[[], None], ttl_s: float) -> None:
        """Fence this store with lease ``term`` of ``ttl_s`` seconds (PostgreSQL only,
        :mod:`.lease`): every write transaction from now on first checks that the term still
        holds, and one that finds another calls ``on_fenced`` and fails with
        :class:`~tuneplane.coordinator.store.handle.Fenced`, keeping nothing. One that stalls
        idle for the lease's time is ended by the database
        (:mod:`~tuneplane.coordinator.store.fence`)."""
        from .postgres import PostgresBackend

        if not isinstance(self._backend, PostgresBackend):
            raise StoreError(
                f"the {self.LABEL} {self.where} is a SQLite file: only coordinators sharing a "
                "PostgreSQL store have a lease to fence with."
            )
        self._backend.fence(term, on_fenced, ttl_s)

    @property
    def path(self) -> Path:
        """The SQLite file (only for a store on SQLite)."""
        assert isinstance(self.where, Path), f"the {self.LABEL} is not a SQLite file"
        return self.where

    async def close(self) -> None:
        """Wait for shielded transactions still running, then close the connections."""
        if self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)
        await self._backend.close()

    def cut_off(self) -> None:
        """The database is out of reach and this coordinator is stepping down: fail every
        write in flight now (PostgreSQL: its connections are dropped) rather than let each wait
        on a dead link."""
        from .postgres import PostgresBackend

        for task in list(self._inflight):
            task.cancel()
        if isinstance(self._backend, PostgresBackend):
            self._backend.terminate_now()

    async def abandon(self) -> None:
        """Close at once, waiting for nothing: a coordinator that lost its lease (and perhaps
        its link to the database) must stop, and whatever it still had in flight would be
        refused by its fence anyway. Transactions in flight are rolled back by the database."""
        for task in list(self._inflight):
            task.cancel()
        await self._backend.abandon()

    async def schema_version(self) -> int:
        rows = await self.reader.execute_fetchall(f"SELECT version FROM {self.VERSION_TABLE}")
        return int(rows[0][0])

    @property
    def latest_version(self) -> int:
        return self.MIGRATIONS[-1][0]

    async def _version(self, db: Handle) -> int:
        table = self.VERSION_TABLE
        rows = await db.execute_fetchall(f"SELECT version FROM {table}")
        current = int(rows[0][0]) if rows else 0
        if current > self.latest_version:
            raise SchemaTooNew(
                f"the {self.LABEL} {self.where} is at schema version {current}, newer than the "
                f"{self.latest_version} this coordinator understands. Run the newer coordinator."
            )
        return current

    async def _migrate(self) -> None:
        table = self.VERSION_TABLE

        async def start() -> int:
            async with self.transaction() as db:
                await self._backend.prepare_home(db)
                await db.execute(f"CREATE TABLE IF NOT EXISTS {table} (version BIGINT NOT NULL)")
                if not await db.fetchone(f"SELECT version FROM {table}"):
                    await db.execute(f"INSERT INTO {table} (version) VALUES (0)")
                return await self._version(db)

        current = await self._retrying(start)
        for version, statements in self.MIGRATIONS:
            if version <= current:
                continue

            async def step(
                version: int = version, statements: tuple[str, ...] = statements
            ) -> bool:
                async with self.transaction() as db:
                    if await self._version(db) >= version:
                        return False  # another process applied it meanwhile
                    for sql in statements:
                        await db.execute(self._backend.migration_sql(sql))
                    await db.execute(f"UPDATE {table} SET version = ?", (version,))
                    return True

            if await self._retrying(step):
                log.info(
                    "store migrated store=%r where=%s version=%d", self.LABEL, self.where, version
                )

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Handle]:
        """One write transaction (this process's one at a time, then the backend's lock); what
        it :meth:`changed` goes to the commit observers once it committed."""
        changed: set[str] = set()
        token = _changed.set(changed)
        try:
            async with self._backend.transaction() as db:
                yield db
        finally:
            _changed.reset(token)
        # Reached only when the block and the commit succeeded: an error skips this line.
        if changed:
            names = frozenset(changed)
            for observe in self.commit_observers:
                observe(names)

    def changed(self, name: str) -> None:
        """Record that the transaction running now changed ``name`` (a Job's run id), for the
        commit observers once it committed. Outside a transaction nothing changes: ignored."""
        names = _changed.get()
        if names is not None:
            names.add(name)

    async def _retrying(self, work: Callable[[], Awaitable[T]]) -> T:
        """``work()``, run again whole while the database aborts it for a conflict."""
        attempt = 1
        while True:
            try:
                return await work()
            except TransactionConflict as exc:
                if attempt >= MAX_ATTEMPTS:
                    raise StoreUnavailable(
                        f"the {self.LABEL} {self.where} aborted the same change {attempt} times "
                        f"for conflicts with another writer (last: {exc.reason}); nothing of it "
                        "was kept. Find what else writes to the store (pg_stat_activity), then "
                        "try again."
                    ) from exc
                event = StoreRetry(self.LABEL, exc.reason, attempt)
                log.warning(
                    "store retry store=%r reason=%s attempt=%d", event.store, event.reason, attempt
                )
                for observe in self.retry_observers:
                    observe(event)
                attempt += 1

    async def shielded(self, work: Callable[[], Awaitable[T]]) -> T:
        """Run ``work()`` (a whole transaction, re-run on a conflict) to completion even if the
        caller is cancelled (a deadline passed)."""
        task = asyncio.ensure_future(self._retrying(work))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        # A caller cancelled meanwhile never reads the outcome: its failure (a fenced write of a
        # coordinator stepping down) is the caller's business, not asyncio's "never retrieved".
        task.add_done_callback(_retrieved)
        return await asyncio.shield(task)

    # ----- copying a store ---------------------------------------------------------------------

    async def tables(self) -> list[str]:
        """This store's tables (its version table left out), each after those it references."""
        names, edges = await self._backend.table_facts()
        return [t for t in dependency_order(names, edges) if t != self.VERSION_TABLE]

    async def columns(self, table: str) -> list[str]:
        """``table``'s columns in their declared order."""
        return await self._backend.columns(self.known_column(table, await self.tables()))

    async def read_rows(self, table: str, size: int = COPY_BATCH) -> AsyncIterator[list[Row]]:
        """Every row of ``table`` (all columns, in :meth:`columns` order), in batches."""
        names = ", ".join(f'"{c}"' for c in await self.columns(table))
        async for batch in self._backend.batches(f'SELECT {names} FROM "{table}"', size):
            yield batch

    async def insert_rows(
        self, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]
    ) -> int:
        """Insert ``rows`` (values in ``columns`` order) into ``table`` as they are, ids
        included, in one transaction; returns how many were inserted."""
        known = await self.columns(table)
        for column in columns:
            self.known_column(column, known)
        names = ", ".join(f'"{c}"' for c in columns)
        marks = ", ".join("?" for _ in columns)

        async def work() -> int:
            async with self.transaction() as db:
                done = await db.executemany(
                    f'INSERT INTO "{table}" ({names}) VALUES ({marks})', rows
                )
                await self._backend.after_insert(db, table)
                return done.rowcount

        return await self.shielded(work)

    async def read_snapshot(self, work: Callable[[SnapshotReader], T]) -> T:
        """``work`` in a worker thread, reading every table as of one moment (a copy and the
        check of it read the same rows), on a connection of its own: a million rows neither stall
        the event loop nor wait behind the writer."""
        return await self._backend.snapshot(work)

    @asynccontextmanager
    async def loading(self) -> AsyncIterator[Loader]:
        """One write transaction for rows copied in as they are, ids included
        (:meth:`Loader.insert`, any number of times, any tables). When the block ends, each
        identity column numbers on past the largest id and the transaction commits; an error in
        the block keeps nothing of it."""
        async with self.transaction() as db:
            yield Loader(self, db)
            for table in await self.tables():
                await self._backend.after_insert(db, table)

    def known_column(self, name: str, known: Sequence[str]) -> str:
        if name not in known:
            raise StoreError(
                f"the {self.LABEL} {self.where} has no table or column {name!r}. Name one of: "
                f"{', '.join(known)}."
            )
        return name


def _retrieved(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


class Loader:
    """Rows going into one :meth:`StoreDb.loading` transaction."""

    def __init__(self, store: StoreDb, db: Handle) -> None:
        self._store = store
        self._db = db
        self._columns: dict[str, list[str]] = {}

    async def insert(
        self, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]
    ) -> int:
        """Insert ``rows`` (values in ``columns`` order) into ``table``; how many went in."""
        if table not in self._columns:
            self._columns[table] = await self._store.columns(table)
        known = self._columns[table]
        for column in columns:
            self._store.known_column(column, known)
        names = ", ".join(f'"{c}"' for c in columns)
        marks = ", ".join("?" for _ in columns)
        done = await self._db.executemany(f'INSERT INTO "{table}" ({names}) VALUES ({marks})', rows)
        return done.rowcount
