"""What store code holds while it reads or writes, on either backend, and the errors it may see.

Rules:
- Store code writes ``?`` SQL and calls four methods on a :class:`Handle`: ``execute`` (a
  :class:`Result` with ``rowcount``), ``execute_fetchall`` (rows), ``executemany`` (the total
  ``rowcount``) and ``fetchone`` (the first row or None). Rows are read by index and by column
  name. The SQLite and PostgreSQL handles behave the same; nothing else of a driver leaks out.
- Errors are neutral: a broken UNIQUE, FOREIGN KEY, CHECK or NOT NULL rule is
  :class:`IntegrityViolation` on both backends; a database that cannot be reached or stays
  locked is :class:`StoreUnavailable`. :class:`TransactionConflict` (a serialisation failure or
  deadlock) never reaches store code: the base re-runs the whole transaction.
- Every message is a sentence for a person; a PostgreSQL password never appears in one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

import attrs


class StoreError(Exception):
    """Base of the store errors; the message is a sentence for the caller."""


class SchemaTooNew(StoreError):
    """The database was written by a newer coordinator."""


class IntegrityViolation(StoreError):
    """A write broke a rule of the schema (UNIQUE, FOREIGN KEY, CHECK, NOT NULL); nothing of
    the transaction it was in is kept."""


class StoreUnavailable(StoreError):
    """The database cannot be reached, refused us, or stayed locked; nothing was changed."""


class Fenced(StoreError):
    """This coordinator's lease was taken over: the write was refused and nothing of it kept.
    The coordinator stops acting and goes back to standby (:mod:`..leadership`)."""


class TransactionConflict(StoreError):
    """The database aborted a transaction to resolve a conflict with another writer; it is
    re-run whole (:meth:`~tuneplane.coordinator.store.db.StoreDb.shielded`).

    ``reason``: ``serialization`` (SQLSTATE 40001) or ``deadlock`` (40P01).
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class Row(Protocol):
    """One row: by index (``row[0]``), by column name (``row["state"]``), or unpacked."""

    def __getitem__(self, key: Any, /) -> Any: ...

    def __iter__(self) -> Iterator[Any]: ...

    def __len__(self) -> int: ...


@attrs.frozen
class Result:
    """What a write did: how many rows it changed (-1 when the statement does not say)."""

    rowcount: int


class Handle(Protocol):
    """The store code's view of the database, inside a transaction or for a read."""

    async def execute(self, sql: str, args: Sequence[Any] = ()) -> Result: ...

    async def execute_fetchall(self, sql: str, args: Sequence[Any] = ()) -> list[Row]: ...

    async def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> Result: ...

    async def fetchone(self, sql: str, args: Sequence[Any] = ()) -> Row | None: ...


async def first_row(db: Handle, sql: str, args: Sequence[Any] = ()) -> Any:
    """The first row of a query, or None."""
    return await db.fetchone(sql, args)


class SnapshotCursor(Protocol):
    """The rows of one statement of a :class:`SnapshotReader` (a subset of a DB-API cursor)."""

    arraysize: int

    def fetchone(self) -> Any: ...

    def fetchmany(self, size: int = ..., /) -> list[Any]: ...

    def fetchall(self) -> list[Any]: ...


class SnapshotReader(Protocol):
    """Reads in a worker thread, all from one snapshot (a read-only transaction) on a
    connection of their own; a :class:`sqlite3.Connection` is one. ``?`` SQL, as everywhere."""

    def execute(self, sql: str, parameters: Any = ..., /) -> SnapshotCursor: ...


def integrity_sentence(what: str, detail: str) -> str:
    """The message of an :class:`IntegrityViolation` in ``what`` (the store's label and place)."""
    return (
        f"the {what} refused a write that breaks a rule of its schema ({detail}); nothing of "
        "that change was kept. Check what is already recorded, then try again."
    )
