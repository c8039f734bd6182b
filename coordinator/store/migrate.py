"""The store half of ``tuneplane-coordinator migrate-store``: an installation's SQLite stores,
copied into a PostgreSQL database and checked (the command around it, with the state directory,
its lock and coordinator.toml, is :mod:`~tuneplane.coordinator.server.migrate_store`).

Rules:
- Every refusal is a :class:`MigrateError` (or a store's own error) with a sentence naming what
  and how to fix it, raised before anything is written: a target that cannot be reached or
  whose stores already hold rows (read in one read-only transaction).
- A source store at an older schema version is migrated when it is opened, before the copy;
  :attr:`Migration.notes` says so. A store file ``serve`` never made is copied as empty.
- Each store is read from one snapshot of its file, table by table in dependency order, in
  batches, and written in one transaction of the target; the three transactions commit together
  after the last row of the last store is in, so a failure anywhere keeps nothing of any store.
  Identity columns then number on past the copied ids.
- Then every table is read back from one snapshot of the target and its row count and digest
  (:mod:`store_digest`) compared with the source's. A mismatch is :class:`Mismatched`: the copy
  stays in the target for the operator to look at and drop (:func:`drop_advice`).
- The URL shows as :class:`PostgresUrl` prints it: never with its password.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack, closing
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import asyncpg
import attrs

from ..store_location import PostgresUrl
from .core import DB_NAME, Store
from .db import COPY_BATCH, Loader, StoreDb
from .digest import (
    DigestError,
    Mismatch,
    TableDigest,
    TableDigester,
    compare,
    order_by,
)
from .handle import SnapshotReader, StoreError
from .logs import DB_NAME as LOGS_DB
from .logs import LogStore
from .postgres import CONNECT_ERRORS, CONNECT_TIMEOUT_S, connect_sentence
from .telemetry import DB_NAME as TELEMETRY_DB
from .telemetry import TelemetryStore

log = logging.getLogger(__name__)

COMMAND = "migrate-store"
#: Each store class and its SQLite file in the state directory, in the order they are copied.
STORES: tuple[tuple[type[StoreDb], str], ...] = (
    (Store, DB_NAME),
    (TelemetryStore, TELEMETRY_DB),
    (LogStore, LOGS_DB),
)
#: What a failure while writing the target may raise besides the store's own errors.
_WRITE_ERRORS = (
    StoreError,
    DigestError,
    sqlite3.Error,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    OSError,
)


class MigrateError(RuntimeError):
    """``migrate-store`` refused or failed; ``str()`` says what, what was kept and what to do."""


class Mismatched(MigrateError):
    """The copy differs from its source; ``mismatches`` say where."""

    def __init__(
        self, message: str, source: list[TableDigest], target: list[TableDigest],
        mismatches: list[Mismatch],
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.source = source
        self.target = target
        self.mismatches = mismatches


@attrs.frozen
class Migration:
    """What was copied: every table's digest (the same on both sides), and sentences about the
    source's schema upgrades and files that did not exist yet."""

    digests: list[TableDigest]
    notes: list[str]


@attrs.define
class _Pair:
    """One store: its source file (None when it was never made), both sides once open."""

    cls: type[StoreDb]
    path: Path
    source: StoreDb | None = None
    target: StoreDb | None = None
    primary_keys: dict[str, list[str]] = attrs.field(factory=dict)
    digests: list[TableDigest] = attrs.field(factory=list)


def drop_advice(url: PostgresUrl) -> str:
    """How the operator drops what a failed or mismatched copy left in the target."""
    schemas = ", ".join(cls.SCHEMA for cls, _ in STORES)
    return (
        f"Drop what it holds before trying again: `DROP SCHEMA {schemas} CASCADE;` in psql "
        f"connected to {url} (or drop the whole database with dropdb if it holds nothing else)."
    )


async def copy_and_check(
    state_dir: Path, url: PostgresUrl, say: Callable[[str], None] = lambda _: None
) -> Migration:
    """Copy the SQLite stores of ``state_dir`` into the empty database ``url`` and check the
    copy, table by table; :class:`Mismatched` when it differs. The caller holds the state
    directory alone (:func:`~tuneplane.coordinator.server.migrate_store.migrate`)."""
    await _check_target_empty(url)
    say(f"Copying the SQLite stores of {state_dir} into {url}.")
    pairs = [_Pair(cls, state_dir / name) for cls, name in STORES]
    notes: list[str] = []
    async with AsyncExitStack() as stack:
        for pair in pairs:
            note = await _open_source(stack, pair)
            if note:
                notes.append(note)
                say(note)
        for pair in pairs:
            await _open_target(stack, pair, url)
        await _copy_all(pairs, url)
        copied = sum(d.rows for p in pairs for d in p.digests)
        say(f"Copied {copied} rows into {url} in one transaction per store; checking them.")
        source = [d for p in pairs for d in p.digests]
        target = await _verify(pairs)
        mismatches = compare(source, target)
        if mismatches:
            first = mismatches[0]
            raise Mismatched(
                f"The copy in {url} differs from the SQLite stores: the {first.store} table "
                f"{first.table}: {first.sentence} ({len(mismatches)} table(s) differ). "
                "coordinator.toml was not changed: the coordinator still uses the SQLite "
                "files. The copy was left in the target for you to inspect. " + drop_advice(url),
                source,
                target,
                mismatches,
            )
    log.info("stores copied where=%s tables=%d rows=%d", url, len(source), copied)
    return Migration(source, notes)


async def _check_target_empty(url: PostgresUrl) -> None:
    """Refuse a target that cannot be reached or where any store table holds a row, reading it
    in one read-only transaction (nothing is created)."""
    versions = {cls.SCHEMA: cls.VERSION_TABLE for cls, _ in STORES}
    try:
        conn = await asyncpg.connect(
            dsn=url.dsn(), timeout=CONNECT_TIMEOUT_S,
            server_settings={"application_name": "tuneplane-coordinator"},
        )  # fmt: skip
    except CONNECT_ERRORS as exc:
        raise MigrateError(connect_sentence(url, "target database", exc)) from None
    try:
        async with conn.transaction(readonly=True):
            tables = await conn.fetch(
                "SELECT table_schema, table_name FROM information_schema.tables "
                "WHERE table_schema = ANY($1::text[]) AND table_type = 'BASE TABLE' "
                "ORDER BY 1, 2",
                list(versions),
            )
            full = [
                f"{schema}.{table}"
                for schema, table in ((str(r[0]), str(r[1])) for r in tables)
                if table != versions[schema]
                and await conn.fetchval(f'SELECT EXISTS (SELECT 1 FROM "{schema}"."{table}")')
            ]
    except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
        raise MigrateError(
            f"The target database {url} could not be read ({type(exc).__name__}: {exc}). Check "
            f"that the user may read it, then run {COMMAND} again. Nothing was changed."
        ) from None
    finally:
        await conn.close()
    if full:
        shown = ", ".join(full[:5]) + (f" and {len(full) - 5} more" if len(full) > 5 else "")
        raise MigrateError(
            f"The target database {url} already holds a coordinator's rows ({shown}); "
            f"{COMMAND} copies only into a database whose stores are empty. Name a new, empty "
            f"database in --to (createdb), or, if these rows are left from an earlier attempt, "
            f"drop them: `DROP SCHEMA {', '.join(versions)} CASCADE;` in psql. Nothing was "
            "changed."
        )


def _file_version(pair: _Pair) -> int | None:
    """The schema version the SQLite file is at now, read-only; None when there is no file."""
    if not pair.path.exists():
        return None
    with closing(sqlite3.connect(f"file:{pair.path}?mode=ro", uri=True, timeout=10)) as db:
        try:
            row = db.execute(f"SELECT version FROM {pair.cls.VERSION_TABLE}").fetchone()
        except sqlite3.OperationalError:
            return 0
    return int(row[0]) if row else 0


async def _open_source(stack: AsyncExitStack, pair: _Pair) -> str:
    """Open the source store (migrating an older one); a sentence when it was migrated or has
    no file yet, else ""."""
    before = _file_version(pair)
    if before is None:
        return (
            f"The {pair.cls.LABEL} has no file yet ({pair.path.name}: serve never opened it); "
            "its tables are created empty in the target."
        )
    pair.source = await pair.cls.open(pair.path)
    stack.push_async_callback(pair.source.close)
    after = await pair.source.schema_version()
    if after != before:
        return (
            f"The {pair.cls.LABEL} {pair.path.name} was at schema version {before}; opening it "
            f"migrated it to {after} before the copy."
        )
    return ""


async def _open_target(stack: AsyncExitStack, pair: _Pair, url: PostgresUrl) -> None:
    """Open the target store (creating its schema and tables); its tables must be the source's."""
    try:
        pair.target = await pair.cls.open(url)
    except (asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise MigrateError(
            f"The target database {url} refused to create the {pair.cls.LABEL}'s schema "
            f"{pair.cls.SCHEMA} ({type(exc).__name__}: {exc}). Let the user create schemas "
            f"there (GRANT CREATE ON DATABASE ...), then run {COMMAND} again; nothing was "
            "copied."
        ) from None
    stack.push_async_callback(pair.target.close)
    if pair.source is None:
        return
    mine, theirs = await pair.source.tables(), await pair.target.tables()
    if sorted(mine) != sorted(theirs):
        raise MigrateError(
            f"The {pair.cls.LABEL} has the tables {', '.join(sorted(mine))} in SQLite but "
            f"{', '.join(sorted(theirs))} in {url}, at the same schema version; this "
            f"coordinator's migrations disagree between the backends. Nothing was copied. "
            "Report it with both lists."
        )
    for table in mine:
        src, dst = await pair.source.columns(table), await pair.target.columns(table)
        if sorted(src) != sorted(dst):
            raise MigrateError(
                f"The {pair.cls.LABEL} table {table} has the columns {', '.join(src)} in SQLite "
                f"but {', '.join(dst)} in {url}; nothing was copied. Report it with both lists."
            )


async def _copy_all(pairs: Sequence[_Pair], url: PostgresUrl) -> None:
    """Every source into its target: one target transaction per store, all three committed
    only once the last row is in."""
    where = {"store": "", "table": "", "step": "copy"}
    try:
        async with AsyncExitStack() as transactions:
            for pair in pairs:
                assert pair.target is not None
                loader = await transactions.enter_async_context(pair.target.loading())
                where["store"] = pair.cls.LABEL
                if pair.source is not None:
                    await _copy(pair, loader, where)
            where["step"] = "commit"
    except _WRITE_ERRORS as exc:
        failure = f"{type(exc).__name__}: {exc}"
        if where["step"] == "commit":
            raise MigrateError(
                f"Committing the copy into {url} failed ({failure}), so some stores may have "
                "been kept there and others not; coordinator.toml was not changed. "
                f"{drop_advice(url)}"
            ) from None
        table = f" table {where['table']}" if where["table"] else ""
        raise MigrateError(
            f"Copying the {where['store']}{table} into {url} failed ({failure}); nothing of "
            "any store was kept there (every transaction was rolled back) and coordinator.toml "
            f"was not changed. Fix the cause, then run {COMMAND} again."
        ) from None


async def _copy(pair: _Pair, loader: Loader, where: dict[str, str]) -> None:
    """One source store into the target's ``loader`` transaction, from one snapshot of the file;
    the source's digests and primary keys are kept on ``pair``."""
    assert pair.source is not None
    tables = await pair.source.tables()
    columns = {t: await pair.source.columns(t) for t in tables}

    def work(reader: SnapshotReader) -> None:
        for table in tables:
            where["table"] = table
            names = columns[table]
            key = [
                str(r[0])
                for r in reader.execute(
                    "SELECT name FROM pragma_table_info(?) WHERE pk > 0 ORDER BY pk", (table,)
                ).fetchall()
            ]
            pair.primary_keys[table] = key
            quoted = ", ".join(f'"{c}"' for c in names)
            digester = TableDigester(pair.cls.LABEL, table, names)
            cursor = reader.execute(f'SELECT {quoted} FROM "{table}" {order_by(names, key)}')
            while batch := cursor.fetchmany(COPY_BATCH):
                rows = [tuple(r) for r in batch]
                digester.add(rows)
                anyio.from_thread.run(loader.insert, table, names, rows)
            pair.digests.append(digester.result())
        where["table"] = ""

    await pair.source.read_snapshot(work)


async def _verify(pairs: Sequence[_Pair]) -> list[TableDigest]:
    """Every copied table's digest, read back from one snapshot of each target store, in the
    order and with the columns and primary keys of its source."""
    found: list[TableDigest] = []
    for pair in pairs:
        assert pair.target is not None
        if pair.source is None:
            continue
        wanted = [(d.table, await pair.source.columns(d.table)) for d in pair.digests]

        def work(
            reader: SnapshotReader, pair: _Pair = pair, wanted: list[Any] = wanted
        ) -> list[TableDigest]:
            out = []
            for table, names in wanted:
                quoted = ", ".join(f'"{c}"' for c in names)
                key = pair.primary_keys[table]
                cursor = reader.execute(f'SELECT {quoted} FROM "{table}" {order_by(names, key)}')
                digester = TableDigester(pair.cls.LABEL, table, names)
                while batch := cursor.fetchmany(COPY_BATCH):
                    digester.add(tuple(r) for r in batch)
                out.append(digester.result())
            return out

        found += await pair.target.read_snapshot(work)
    return found
