"""The PostgreSQL backend of a store: a schema of its own in one database, an asyncpg pool.

Rules:
- Each store class keeps its tables in its own schema (``tuneplane``, ``tuneplane_telemetry``,
  ``tuneplane_logs``) of the database the URL names, with its own version table there; every
  pooled connection has ``search_path`` set to it, so store SQL names tables bare.
- Writers are serialised across processes by a transaction-scoped advisory lock per store
  (:func:`write_lock_key`), taken first in every write transaction, under READ COMMITTED. Two
  coordinators, or the admin CLI beside ``serve``, take turns exactly as SQLite's
  ``BEGIN IMMEDIATE`` makes them: each transaction reads what the one before it committed, and
  no two of ours can deadlock or fail serialisation. SERIALIZABLE would make every reader pay
  for predicate locks and re-run transactions that only overlapped; one writer at a time is
  what the store's decisions assume anyway.
- A transaction that still meets a deadlock or serialisation failure (a person's ``psql``
  session holding rows, say) is :class:`TransactionConflict`, which the base re-runs whole. A
  lock held past :data:`LOCK_TIMEOUT` is :class:`StoreUnavailable`, as SQLite's busy timeout is.
- Reads outside a transaction take any pooled connection; they see what is committed.
- ``?`` SQL is rewritten once per string (:mod:`store_sql`). Errors become the neutral ones of
  :mod:`store_handle`. A connection that cannot be made is one sentence naming the URL without
  its password (:class:`~tuneplane.coordinator.store_location.PostgresUrl`), what failed and how
  to fix it.
"""

from __future__ import annotations

import contextlib
import hashlib
import socket
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

import anyio
import anyio.from_thread
import asyncpg

from ..store_location import PostgresUrl
from .fence import LeaseFence
from .handle import (
    Handle,
    IntegrityViolation,
    Result,
    Row,
    SnapshotReader,
    StoreUnavailable,
    TransactionConflict,
    integrity_sentence,
)
from .sql import ddl_to_postgres, to_postgres

T = TypeVar("T")
CONNECT_TIMEOUT_S = 10.0
LOCK_TIMEOUT = "10s"
IDLE_IN_TRANSACTION_TIMEOUT = "30s"
POOL_SIZE = 8
STREAM_CHUNK = 10_000
_DML = ("INSERT", "UPDATE", "DELETE")
_CONFLICTS = {"40001": "serialization", "40P01": "deadlock"}
#: What connecting may raise: unreachable, refused, timed out, or (ValueError) a URL parameter
#: the driver does not take.
CONNECT_ERRORS = (OSError, TimeoutError, ValueError, asyncpg.PostgresError, asyncpg.InterfaceError)


def write_lock_key(schema: str) -> int:
    """The advisory lock (a signed 64-bit key) every write transaction of ``schema`` takes."""
    digest = hashlib.sha256(f"tuneplane store {schema}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def _rowcount(status: str) -> int:
    """The row count a command status ends with ("UPDATE 3", "INSERT 0 1"); -1 without one."""
    last = status.rsplit(" ", 1)[-1] if status else ""
    return int(last) if last.isdigit() else -1


class _Mapper:
    """Turns asyncpg's errors into the store's neutral ones."""

    def __init__(self, what: str) -> None:
        self.what = what

    @contextlib.contextmanager
    def mapped(self) -> Iterator[None]:
        try:
            yield
        except asyncpg.IntegrityConstraintViolationError as exc:
            raise IntegrityViolation(integrity_sentence(self.what, str(exc))) from exc
        except asyncpg.TransactionRollbackError as exc:
            reason = _CONFLICTS.get(str(exc.sqlstate))
            if reason is None:
                raise
            raise TransactionConflict(
                f"the {self.what} aborted a transaction that conflicted with another writer "
                f"({reason}: {exc})",
                reason,
            ) from exc
        except asyncpg.LockNotAvailableError as exc:
            raise StoreUnavailable(
                f"the {self.what} stayed locked by another session for {LOCK_TIMEOUT} ({exc}); "
                "nothing was changed. Find the session holding it (pg_stat_activity), end it, "
                "and try again."
            ) from exc
        except (OSError, asyncpg.InterfaceError, asyncpg.PostgresConnectionError) as exc:
            raise StoreUnavailable(
                f"the connection to the {self.what} failed ({type(exc).__name__}: {exc}); the "
                "change in flight was not kept. Check that PostgreSQL is up, then try again."
            ) from exc


class PgHandle:
    """A :class:`~tuneplane.coordinator.store.handle.Handle` on one connection (a transaction)."""

    def __init__(self, conn: Any, mapper: _Mapper) -> None:
        self._conn = conn
        self._mapper = mapper

    async def execute(self, sql: str, args: Sequence[Any] = ()) -> Result:
        with self._mapper.mapped():
            return Result(_rowcount(await self._conn.execute(to_postgres(sql), *args)))

    async def execute_fetchall(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        with self._mapper.mapped():
            return list(await self._conn.fetch(to_postgres(sql), *args))

    async def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> Result:
        batch = [tuple(r) for r in rows]
        if not batch:
            return Result(0)
        query = to_postgres(sql)
        with self._mapper.mapped():
            if not query.lstrip().upper().startswith(_DML):
                await self._conn.executemany(query, batch)
                return Result(-1)
            # One pipelined round of statements; each returns a row per row it changed.
            if " RETURNING " not in f" {query.upper()} ":
                query += " RETURNING 1"
            return Result(len(await self._conn.fetchmany(query, batch)))

    async def fetchone(self, sql: str, args: Sequence[Any] = ()) -> Row | None:
        rows = await self.execute_fetchall(sql, args)
        return rows[0] if rows else None


class _PgCursor:
    """A DB-API-like cursor over an asyncpg server-side cursor, used from a worker thread."""

    arraysize = 1

    def __init__(self, conn: Any, sql: str, args: tuple[Any, ...]) -> None:
        async def open_cursor() -> Any:
            return await conn.cursor(sql, *args)

        self._cursor = anyio.from_thread.run(open_cursor)

    def fetchmany(self, size: int = 0, /) -> list[Any]:
        return list(anyio.from_thread.run(self._cursor.fetch, size or self.arraysize))

    def fetchone(self) -> Any:
        return anyio.from_thread.run(self._cursor.fetchrow)

    def fetchall(self) -> list[Any]:
        rows: list[Any] = []
        while chunk := self.fetchmany(STREAM_CHUNK):
            rows += chunk
        return rows


class _PgSnapshot:
    """A :class:`~tuneplane.coordinator.store.handle.SnapshotReader` on one connection."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def execute(self, sql: str, parameters: Any = (), /) -> _PgCursor:
        return _PgCursor(self._conn, to_postgres(sql), tuple(parameters))


class PgPoolHandle:
    """A handle for reads (and lone statements) outside a transaction: any pooled connection."""

    def __init__(self, pool: Any, mapper: _Mapper) -> None:
        self._pool = pool
        self._mapper = mapper

    @asynccontextmanager
    async def _one(self) -> AsyncIterator[PgHandle]:
        with self._mapper.mapped():
            async with self._pool.acquire() as conn:
                yield PgHandle(conn, self._mapper)

    async def execute(self, sql: str, args: Sequence[Any] = ()) -> Result:
        async with self._one() as db:
            return await db.execute(sql, args)

    async def execute_fetchall(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        async with self._one() as db:
            return await db.execute_fetchall(sql, args)

    async def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> Result:
        async with self._one() as db:
            return await db.executemany(sql, rows)

    async def fetchone(self, sql: str, args: Sequence[Any] = ()) -> Row | None:
        async with self._one() as db:
            return await db.fetchone(sql, args)


async def connect_pool(url: PostgresUrl, what: str, server_settings: dict[str, str]) -> Any:
    """An asyncpg pool on ``url``; one sentence without the password when it cannot be made."""
    try:
        return await asyncpg.create_pool(
            dsn=url.dsn(),
            min_size=1,
            max_size=POOL_SIZE,
            timeout=CONNECT_TIMEOUT_S,
            server_settings={"application_name": "tuneplane-coordinator", **server_settings},
        )
    except CONNECT_ERRORS as exc:
        raise StoreUnavailable(connect_sentence(url, what, exc)) from None


def connect_sentence(url: PostgresUrl, what: str, exc: BaseException) -> str:
    """Why the ``what`` at ``url`` cannot be reached, and what to do, without the password."""
    detail = _scrubbed(url, f"{type(exc).__name__}: {exc}".rstrip(": "))
    if isinstance(
        exc, asyncpg.InvalidPasswordError | asyncpg.InvalidAuthorizationSpecificationError
    ):
        fix = (
            "Check the user name in the URL and give its password through PGPASSWORD or "
            "~/.pgpass (a password in the URL works too, but shows in process lists)."
        )
        failed = "refused the login"
    elif isinstance(exc, asyncpg.InvalidCatalogNameError):
        fix = "Create the database (createdb) or name one that exists."
        failed = "has no such database"
    elif isinstance(exc, asyncpg.PostgresError):
        fix = "Check the URL's user, database and parameters, and what the server's log says."
        failed = "refused the connection"
    elif isinstance(exc, TimeoutError):
        fix = "Check the host, the port and that no firewall drops the connection."
        failed = f"did not answer within {CONNECT_TIMEOUT_S:g} s"
    elif isinstance(exc, socket.gaierror):
        fix = "Check the host name in the URL."
        failed = "names a host that cannot be resolved"
    else:
        fix = "Check that PostgreSQL runs and listens at the host and port the URL names."
        failed = "cannot be reached"
    return f"The {what} at {url} {failed} ({detail}). {fix}"


def _scrubbed(url: PostgresUrl, text: str) -> str:
    """``text`` with any piece of the URL's password replaced, whatever the driver put in it."""
    parts = urlsplit(url.dsn())
    secrets = [parts.password or "", *parse_qs(parts.query).get("password", [])]
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return text


class PostgresBackend:
    """One store's schema in a PostgreSQL database. Open with :meth:`open`."""

    def __init__(self, pool: Any, url: PostgresUrl, schema: str, what: str) -> None:
        self._pool = pool
        self.url = url
        self.schema = schema
        self._mapper = _Mapper(what)
        self._lock_key = write_lock_key(schema)
        # This process's writers one at a time, each on one pooled connection, before the
        # database's advisory lock serialises them with other processes'.
        self._writers = anyio.Lock()
        self.reader: Handle = PgPoolHandle(pool, self._mapper)
        #: What every write transaction must still find in the lease (None: no fencing, as for
        #: the admin CLI and a coordinator's opening migrations); set by :meth:`fence`.
        self.lease_fence: LeaseFence | None = None

    def fence(self, term: int, on_fenced: Callable[[], None], ttl_s: float) -> None:
        """From now on every write transaction checks that lease ``term`` (of ``ttl_s``
        seconds) still holds, and is ended by the database if it stalls that long
        (:mod:`.fence`)."""
        self.lease_fence = LeaseFence(term, on_fenced, ttl_s)

    @classmethod
    async def open(cls, url: PostgresUrl, schema: str, label: str) -> PostgresBackend:
        """The pool for the store called ``label`` in messages, in ``schema`` at ``url``."""
        settings = {
            "search_path": schema,
            "lock_timeout": LOCK_TIMEOUT,
            # A session holding a transaction open while doing nothing is ended, so its locks
            # cannot hold off the others for ever; a leader's write transactions are ended
            # sooner, after the lease's time (:mod:`.fence`).
            "idle_in_transaction_session_timeout": IDLE_IN_TRANSACTION_TIMEOUT,
        }
        pool = await connect_pool(url, label, settings)
        return cls(pool, url, schema, f"{label} {url}")

    async def close(self) -> None:
        await self._pool.close()

    async def abandon(self) -> None:
        """Drop every connection now, without the goodbye a cut link would never deliver."""
        self._pool.terminate()

    def terminate_now(self) -> None:
        """:meth:`abandon`, from code that cannot wait."""
        self._pool.terminate()

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Handle]:
        with self._mapper.mapped():
            async with (
                self._writers,
                self._pool.acquire() as conn,
                conn.transaction(isolation="read_committed"),
            ):
                if self.lease_fence is None:
                    await conn.execute("SELECT pg_advisory_xact_lock($1)", self._lock_key)
                else:
                    await self.lease_fence.begin(conn, self._lock_key)
                yield PgHandle(conn, self._mapper)

    def migration_sql(self, sql: str) -> str:
        return ddl_to_postgres(sql)

    async def prepare_home(self, db: Handle) -> None:
        """Inside the first transaction (holding the write lock): the store's schema."""
        await db.execute(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"')

    async def table_facts(self) -> tuple[list[str], list[tuple[str, str]]]:
        names = [
            str(r[0])
            for r in await self.reader.execute_fetchall(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = ? "
                "AND table_type = 'BASE TABLE' ORDER BY table_name",
                (self.schema,),
            )
        ]
        edges = [
            (str(r[0]), str(r[1]))
            for r in await self.reader.execute_fetchall(
                "SELECT c.conrelid::regclass::text, c.confrelid::regclass::text "
                "FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace "
                "WHERE c.contype = 'f' AND n.nspname = ?",
                (self.schema,),
            )
        ]
        return names, edges

    async def columns(self, table: str) -> list[str]:
        rows = await self.reader.execute_fetchall(
            "SELECT column_name FROM information_schema.columns WHERE table_schema = ? "
            "AND table_name = ? ORDER BY ordinal_position",
            (self.schema, table),
        )
        return [str(r[0]) for r in rows]

    async def after_insert(self, db: Handle, table: str) -> None:
        """Rows copied in with their ids: each identity column numbers on past the largest."""
        for r in await db.execute_fetchall(
            "SELECT column_name FROM information_schema.columns WHERE table_schema = ? "
            "AND table_name = ? AND is_identity = 'YES'",
            (self.schema, table),
        ):
            column = str(r[0])
            await db.execute(
                f'SELECT setval(pg_get_serial_sequence(?, ?), MAX("{column}")) FROM "{table}" '
                f'HAVING MAX("{column}") IS NOT NULL',
                (f'"{self.schema}"."{table}"', column),
            )

    async def snapshot(self, work: Callable[[SnapshotReader], T]) -> T:
        """``work`` in a worker thread, reading one snapshot (a REPEATABLE READ, READ ONLY
        transaction) on a pooled connection; each fetch hops to the event loop and back."""
        with self._mapper.mapped():
            async with (
                self._pool.acquire() as conn,
                conn.transaction(isolation="repeatable_read", readonly=True),
            ):
                return await anyio.to_thread.run_sync(work, _PgSnapshot(conn))

    async def batches(self, sql: str, size: int) -> AsyncIterator[list[Row]]:
        """The rows of ``sql`` in lists of at most ``size``, from one consistent snapshot."""
        with self._mapper.mapped():
            async with (
                self._pool.acquire() as conn,
                conn.transaction(isolation="repeatable_read", readonly=True),
            ):
                cursor = await conn.cursor(to_postgres(sql))
                while chunk := await cursor.fetch(size):
                    yield list(chunk)


async def create_database(admin_url: str, name: str) -> None:
    """Make the empty database ``name`` on the server at ``admin_url`` (an embedded server's,
    for the demo or a bench phase), for a store to open and migrate."""
    db = await asyncpg.connect(admin_url)
    try:
        await db.execute(f'CREATE DATABASE "{name}"')
    finally:
        await db.close()
