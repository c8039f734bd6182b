"""The leader lease and the coordinators' roll call, in PostgreSQL (schema ``tuneplane_ha``).

Rules (the lease's rules are :mod:`tuneplane.coordinator.leadership`'s):
- Two small tables in a schema of their own, made with ``IF NOT EXISTS`` under an advisory
  lock, outside the stores' numbered migrations: a standby must be able to campaign without
  opening (and migrating) the stores, which only the leader does.
- ``lease`` holds one row: the term, the holder, when it was taken and renewed, when it expires
  (all by the database's clock, epoch ms), and the holder's database session (its backend pid
  and start time), whose disappearance means the holder's process or connection is gone.
- ``coordinators`` holds one row per coordinator that ever served on this store: where it
  listens (the addresses it advertises), its version and pid, when it started and when it was
  last seen (refreshed at every renewal or poll). Nodes, collectors and ``tp`` get the list.
- The desk runs on a connection of its own, never a pooled one, so its session is the
  coordinator's identity in ``pg_stat_activity``. A lock it waits for past
  :data:`LOCK_TIMEOUT` fails the attempt (the next poll tries again).
- :data:`.fence.FENCE_SQL` is what every write transaction of a leading coordinator runs
  first: it holds the lease row shared until the transaction ends, so a takeover (which locks it
  for update) waits for writes in flight, and a write after a takeover finds another term and
  is refused.
"""

from __future__ import annotations

import hashlib
from typing import Any

import asyncpg
import attrs

from ..leadership import LeaseRow
from ..store_location import PostgresUrl
from .fence import LEASE_SCHEMA, stall_limit
from .handle import StoreUnavailable
from .postgres import CONNECT_ERRORS, connect_sentence

SCHEMA = LEASE_SCHEMA
LOCK_TIMEOUT = "2s"
CLOSE_TIMEOUT_S = 2.0
_NOW = "(EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT"
_START_US = "(EXTRACT(EPOCH FROM backend_start) * 1000000)::BIGINT"

_TABLES = (
    f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}",
    f"""CREATE TABLE IF NOT EXISTS {SCHEMA}.lease (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        term BIGINT NOT NULL,
        holder TEXT NOT NULL,
        acquired_ms BIGINT NOT NULL,
        renewed_ms BIGINT NOT NULL,
        expires_ms BIGINT NOT NULL,
        backend_pid INTEGER NOT NULL,
        backend_start_us BIGINT NOT NULL
    )""",
    f"""CREATE TABLE IF NOT EXISTS {SCHEMA}.coordinators (
        id TEXT PRIMARY KEY,
        host TEXT NOT NULL,
        pid BIGINT NOT NULL,
        version TEXT NOT NULL,
        api_address TEXT NOT NULL,
        control_address TEXT NOT NULL,
        telemetry_address TEXT NOT NULL,
        metrics_address TEXT NOT NULL,
        started_ms BIGINT NOT NULL,
        seen_ms BIGINT NOT NULL,
        backend_pid INTEGER NOT NULL,
        backend_start_us BIGINT NOT NULL
    )""",
)


def _alive(table: str) -> str:
    """Whether the database session named in ``table``'s row still exists."""
    return (
        f"EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = {table}.backend_pid AND "
        f"(a.backend_start IS NULL OR (EXTRACT(EPOCH FROM a.backend_start) * 1000000)::BIGINT "
        f"= {table}.backend_start_us))"
    )


_READ_LEASE = f"""
    SELECT l.term, l.holder, l.acquired_ms, l.expires_ms, {_NOW} AS now_ms, {_alive("l")} AS alive
    FROM {SCHEMA}.lease l WHERE l.id = 1"""
_OWN_SESSION = (
    f"pg_backend_pid(), (SELECT {_START_US} FROM pg_stat_activity WHERE pid = pg_backend_pid())"
)


def _schema_lock_key() -> int:
    digest = hashlib.sha256(b"tuneplane lease schema").digest()
    return int.from_bytes(digest[:8], "big", signed=True)


@attrs.frozen
class CoordinatorFacts:
    """What a coordinator says of itself in the roll call."""

    id: str
    host: str
    pid: int
    version: str
    api_address: str
    control_address: str
    telemetry_address: str
    metrics_address: str = ""


@attrs.frozen
class CoordinatorRow:
    """One coordinator of the roll call, as read (times epoch ms, by the database's clock)."""

    facts: CoordinatorFacts
    started_ms: int
    seen_ms: int
    #: Whether its database session (its lease desk's) still exists: False once it stopped.
    alive: bool = True


def _lease(row: Any) -> LeaseRow | None:
    if row is None:
        return None
    return LeaseRow(
        term=int(row["term"]),
        holder=str(row["holder"]),
        acquired_ms=int(row["acquired_ms"]),
        expires_ms=int(row["expires_ms"]),
        now_ms=int(row["now_ms"]),
        holder_alive=bool(row["alive"]),
    )


class LeaseDesk:
    """The lease and the roll call on one connection of their own. Open with :meth:`open`."""

    def __init__(self, conn: Any, url: PostgresUrl) -> None:
        self._conn = conn
        self.url = url

    @classmethod
    async def open(cls, url: PostgresUrl, create: bool = True) -> LeaseDesk:
        """Connect and (with ``create``) make the schema if it is missing; one sentence when it
        cannot. Without ``create`` (``status``: it only reads) a missing schema reads as no
        lease and no coordinators."""
        try:
            conn = await asyncpg.connect(
                dsn=url.dsn(),
                timeout=10.0,
                server_settings={
                    "application_name": "tuneplane-coordinator lease",
                    "lock_timeout": LOCK_TIMEOUT,
                },
            )
        except CONNECT_ERRORS as exc:
            raise StoreUnavailable(connect_sentence(url, "store (leader lease)", exc)) from None
        desk = cls(conn, url)
        if not create:
            return desk
        try:
            async with desk._unavailable_said(), conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1)", _schema_lock_key())
                for sql in _TABLES:
                    await conn.execute(sql)
        except BaseException:
            await conn.close()
            raise
        return desk

    async def close(self) -> None:
        """Close the connection (dropped after :data:`CLOSE_TIMEOUT_S` when the database does
        not answer: a cut link)."""
        await self._conn.close(timeout=CLOSE_TIMEOUT_S)

    def _unavailable_said(self) -> Any:
        return _Unavailable(self.url)

    async def register(self, facts: CoordinatorFacts) -> None:
        """This coordinator's roll-call row, made or replaced (a restart names new addresses)."""
        async with self._unavailable_said():
            await self._conn.execute(
                f"INSERT INTO {SCHEMA}.coordinators (id, host, pid, version, api_address, "
                "control_address, telemetry_address, metrics_address, started_ms, seen_ms, "
                "backend_pid, backend_start_us) "
                f"VALUES ($1, $2, $3, $4, $5, $6, $7, $8, {_NOW}, {_NOW}, {_OWN_SESSION}) "
                "ON CONFLICT (id) DO UPDATE SET host = EXCLUDED.host, pid = EXCLUDED.pid, "
                "version = EXCLUDED.version, api_address = EXCLUDED.api_address, "
                "control_address = EXCLUDED.control_address, "
                "telemetry_address = EXCLUDED.telemetry_address, "
                "metrics_address = EXCLUDED.metrics_address, started_ms = EXCLUDED.started_ms, "
                "seen_ms = EXCLUDED.seen_ms, backend_pid = EXCLUDED.backend_pid, "
                "backend_start_us = EXCLUDED.backend_start_us",
                facts.id,
                facts.host,
                facts.pid,
                facts.version,
                facts.api_address,
                facts.control_address,
                facts.telemetry_address,
                facts.metrics_address,
            )

    async def seen(self, coordinator_id: str) -> None:
        """This coordinator is alive (its row's ``seen_ms`` is now)."""
        async with self._unavailable_said():
            await self._conn.execute(
                f"UPDATE {SCHEMA}.coordinators SET seen_ms = {_NOW} WHERE id = $1",
                coordinator_id,
            )

    async def exists(self) -> bool:
        """Whether a coordinator ever campaigned here (the lease's tables exist)."""
        async with self._unavailable_said():
            found = await self._conn.fetchval("SELECT to_regclass($1)", f"{SCHEMA}.lease")
            return found is not None

    async def read(self) -> LeaseRow | None:
        """The lease as it stands (None: nobody ever held it)."""
        async with self._unavailable_said():
            return _lease(await self._conn.fetchrow(_READ_LEASE))

    async def take(self, me: str, ttl_ms: int, expected: LeaseRow | None) -> int | None:
        """Take the lease for ``me`` if it is still as ``expected`` (what the caller judged):
        the new term, or None when it changed meanwhile (another standby was faster, or the
        leader renewed). Waits for the old leader's write transactions in flight."""
        async with self._unavailable_said(), self._conn.transaction():
            # Paused holding the row locked, this standby would hold off the leader's renewals
            # and writes: the database ends the transaction after the lease's time.
            await self._conn.execute(
                "SELECT set_config('idle_in_transaction_session_timeout', $1, true)",
                stall_limit(ttl_ms / 1000),
            )
            current = await self._conn.fetchrow(_READ_LEASE + " FOR UPDATE OF l")
            if current is None and expected is None:
                await self._conn.execute(
                    f"INSERT INTO {SCHEMA}.lease (id, term, holder, acquired_ms, renewed_ms, "
                    f"expires_ms, backend_pid, backend_start_us) VALUES (1, 1, $1, {_NOW}, "
                    f"{_NOW}, {_NOW} + $2, {_OWN_SESSION}) "
                    "ON CONFLICT (id) DO NOTHING",
                    me,
                    ttl_ms,
                )
                term = await self._conn.fetchval(
                    f"SELECT term FROM {SCHEMA}.lease WHERE id = 1 AND holder = $1", me
                )
                return None if term is None else int(term)
            if current is None or expected is None or int(current["term"]) != expected.term:
                return None
            if bool(current["alive"]) and int(current["expires_ms"]) > int(current["now_ms"]):
                return None  # renewed since, or its session came back: the leader stays
            term = await self._conn.fetchval(
                f"UPDATE {SCHEMA}.lease SET term = term + 1, holder = $1, acquired_ms = {_NOW}, "
                f"renewed_ms = {_NOW}, expires_ms = {_NOW} + $2, "
                f"(backend_pid, backend_start_us) = ({_OWN_SESSION}) "
                "WHERE id = 1 AND term = $3 RETURNING term",
                me,
                ttl_ms,
                expected.term,
            )
            return None if term is None else int(term)

    async def renew(self, me: str, term: int, ttl_ms: int) -> bool:
        """Extend ``me``'s lease of ``term``; False when it is no longer ours (fenced)."""
        async with self._unavailable_said():
            done = await self._conn.fetchval(
                f"UPDATE {SCHEMA}.lease SET renewed_ms = {_NOW}, expires_ms = {_NOW} + $3 "
                "WHERE id = 1 AND holder = $1 AND term = $2 RETURNING term",
                me,
                term,
                ttl_ms,
            )
            if done is not None:
                await self._conn.execute(
                    f"UPDATE {SCHEMA}.coordinators SET seen_ms = {_NOW} WHERE id = $1", me
                )
            return done is not None

    async def resign(self, me: str, term: int) -> bool:
        """End ``me``'s lease of ``term`` now (a clean stop), so a standby takes over at its
        next poll instead of after the lease's time; False when it was not ours any more."""
        async with self._unavailable_said():
            done = await self._conn.fetchval(
                f"UPDATE {SCHEMA}.lease SET expires_ms = {_NOW} "
                "WHERE id = 1 AND holder = $1 AND term = $2 RETURNING term",
                me,
                term,
            )
            return done is not None

    async def roll_call(self) -> list[CoordinatorRow]:
        """Every coordinator that registered, most recently seen first."""
        async with self._unavailable_said():
            rows = await self._conn.fetch(
                f"SELECT id, host, pid, version, api_address, control_address, "
                f"telemetry_address, metrics_address, started_ms, seen_ms, "
                f"{_alive('c')} AS alive FROM {SCHEMA}.coordinators c ORDER BY seen_ms DESC, id"
            )
        return [
            CoordinatorRow(
                CoordinatorFacts(
                    str(r["id"]),
                    str(r["host"]),
                    int(r["pid"]),
                    str(r["version"]),
                    str(r["api_address"]),
                    str(r["control_address"]),
                    str(r["telemetry_address"]),
                    str(r["metrics_address"]),
                ),
                int(r["started_ms"]),
                int(r["seen_ms"]),
                bool(r["alive"]),
            )
            for r in rows
        ]

    async def now_ms(self) -> int:
        """The database's clock (epoch ms)."""
        async with self._unavailable_said():
            return int(await self._conn.fetchval(f"SELECT {_NOW}"))


class _Unavailable:
    """Turns a failed lease statement into one :class:`StoreUnavailable` sentence."""

    def __init__(self, url: PostgresUrl) -> None:
        self.url = url

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, kind: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or isinstance(exc, StoreUnavailable):
            return False
        if isinstance(
            exc,
            OSError | TimeoutError | asyncpg.PostgresError | asyncpg.InterfaceError,
        ):
            raise StoreUnavailable(
                f"the leader lease in the store {self.url} could not be read or written "
                f"({type(exc).__name__}: {exc}); this attempt changed nothing and the next one "
                "follows shortly. Check that PostgreSQL is up and reachable."
            ) from exc
        return False


__all__ = [
    "SCHEMA",
    "CoordinatorFacts",
    "CoordinatorRow",
    "LeaseDesk",
]
