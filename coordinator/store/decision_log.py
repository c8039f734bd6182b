"""Read the append-only decision log from the coordinator store, read-only, while ``serve`` runs.

Rules:
- A SQLite store (``coordinator.db``) is opened with SQLite's ``mode=ro``: this reader can never
  write, lock out the server or create a missing store. WAL lets it read while ``serve`` writes.
- A PostgreSQL store is read on one connection whose transactions are all read-only, in the
  store's schema: nothing is created or migrated, and no write lock is taken.
- Rows come back in the order they were written (their id), filtered by run id and time.
- :func:`job_decisions` is the serving coordinator's own read of one Job's rows, on the store's
  reader (the console's Job page), along the index ``decisions_by_run``; one converter
  (:func:`decision_row`) serves both.
"""

from __future__ import annotations

import datetime
import json
import re
import sqlite3
from pathlib import Path
from typing import Any

import anyio

from ..store_location import PostgresUrl, Where
from ..values.decisions import DecisionRow
from .core import Store

_RELATIVE = re.compile(r"^(\d+)([smhd])$")
_UNITS_MS = {"s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


class DecisionLogError(Exception):
    """The decision log cannot be read as asked; ``str()`` says why and what to do."""


def parse_since(text: str, now_ms: int) -> int:
    """``--since``: a duration back from now (``30s``, ``15m``, ``2h``, ``7d``), an ISO 8601
    time (``2026-11-29T10:00:00``, UTC unless it names a zone) or epoch milliseconds."""
    raw = text.strip()
    match = _RELATIVE.match(raw)
    if match:
        return now_ms - int(match.group(1)) * _UNITS_MS[match.group(2)]
    if raw.isdigit():
        return int(raw)
    try:
        stamp = datetime.datetime.fromisoformat(raw)
    except ValueError:
        raise DecisionLogError(
            f"--since {text!r} is not a time. Write a duration back from now (30s, 15m, 2h, "
            "7d), an ISO 8601 time such as 2026-11-29T10:00:00, or epoch milliseconds."
        ) from None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=datetime.UTC)
    return int(stamp.timestamp() * 1000)


_COLUMNS = "id, at_ms, kind, run_id, attempt, member_index, node_id, detail_json"


#: One Job's newest decisions: read backwards along the index ``decisions_by_run`` (run_id,
#: id), so it touches only that Job's newest rows however long the log is.
JOB_DECISIONS_SQL = f"SELECT {_COLUMNS} FROM decisions WHERE run_id = ? ORDER BY id DESC LIMIT ?"


def read_decisions(where: Where, run_id: str = "", since_ms: int = 0) -> list[DecisionRow]:
    """Every decision (of ``run_id`` when given) at or after ``since_ms``, oldest first, from
    the store at ``where`` (its SQLite file or PostgreSQL database)."""
    clauses: list[str] = ["at_ms >= ?"]
    args: list[int | str] = [since_ms]
    if run_id:
        clauses.append("run_id = ?")
        args.append(run_id)
    sql = f"SELECT {_COLUMNS} FROM decisions WHERE {' AND '.join(clauses)} ORDER BY id"
    if isinstance(where, PostgresUrl):
        rows = anyio.run(_read_postgres, where, sql, args, backend="asyncio")
    else:
        rows = _read_sqlite(where, sql, args)
    return [decision_row(r) for r in rows]


def decision_row(r: Any) -> DecisionRow:
    """A ``decisions`` row (the columns of :data:`_COLUMNS`, in order) as its value."""
    return DecisionRow(
        id=int(r[0]),
        at_ms=int(r[1]),
        kind=str(r[2]),
        run_id=r[3],
        attempt=None if r[4] is None else int(r[4]),
        member_index=None if r[5] is None else int(r[5]),
        node_id=r[6],
        detail=json.loads(r[7]),
    )


async def job_decisions(store: Store, run_id: str, limit: int) -> tuple[list[DecisionRow], bool]:
    """The newest ``limit`` decisions about ``run_id``, oldest first, read by the serving
    coordinator on its store's reader; and whether older ones were left out."""
    rows = await store.reader.execute_fetchall(JOB_DECISIONS_SQL, (run_id, limit + 1))
    found = [decision_row(r) for r in rows]
    return found[:limit][::-1], len(found) > limit


async def _read_postgres(url: PostgresUrl, sql: str, args: list[int | str]) -> list[Any]:
    # Imported here: reading a SQLite store never loads the PostgreSQL driver.
    import asyncpg

    from .postgres import CONNECT_ERRORS, connect_sentence
    from .sql import to_postgres

    try:
        db = await asyncpg.connect(
            dsn=url.dsn(),
            timeout=10,
            server_settings={
                "search_path": Store.SCHEMA,
                "default_transaction_read_only": "on",
                "application_name": "tuneplane-coordinator decisions",
            },
        )
    except CONNECT_ERRORS as exc:
        raise DecisionLogError(connect_sentence(url, "coordinator store", exc)) from None
    try:
        return list(await db.fetch(to_postgres(sql), *args))
    except asyncpg.PostgresError as exc:
        raise DecisionLogError(
            f"the PostgreSQL database {url} has no readable decision log in schema "
            f"{Store.SCHEMA!r} ({type(exc).__name__}: {exc}). Is [store] url the database "
            "`init --store` named?"
        ) from None
    finally:
        await db.close()


def _read_sqlite(db_file: Path, sql: str, args: list[int | str]) -> list[Any]:
    if not db_file.exists():
        raise DecisionLogError(
            f"{db_file} does not exist. Point --state-dir at an initialised coordinator."
        )
    try:
        db = sqlite3.connect(f"{db_file.absolute().as_uri()}?mode=ro", uri=True, timeout=10)
    except sqlite3.Error as exc:
        raise DecisionLogError(f"{db_file} cannot be opened read-only ({exc}).") from None
    try:
        return db.execute(sql, args).fetchall()
    except sqlite3.Error as exc:
        raise DecisionLogError(
            f"{db_file} has no readable decision log ({exc}). Is it a coordinator store?"
        ) from None
    finally:
        db.close()


def format_row(row: DecisionRow) -> str:
    """One line for a person: time, kind, what it concerns, then the detail as key=value."""
    stamp = datetime.datetime.fromtimestamp(row.at_ms / 1000, tz=datetime.UTC)
    about = []
    if row.run_id:
        about.append(row.run_id)
    if row.attempt is not None:
        about.append(f"attempt={row.attempt}")
    if row.member_index is not None:
        about.append(f"member={row.member_index}")
    if row.node_id:
        about.append(f"node={row.node_id}")
    detail = row.detail_text()
    head = f"{stamp:%Y-%m-%d %H:%M:%S.%f}"[:-3] + "Z"
    return "  ".join(p for p in (head, row.kind.ljust(18), " ".join(about), detail) if p)
