"""What ``migrate-store`` checks after copying a store: each table's row count and digest, on
both sides, and which tables differ. Pure: rows in, digests and sentences out.

Rules:
- A table's digest is sha256 over its rows in primary-key order (every column in order when
  the table has no primary key; rows equal in every column are interchangeable), each row one
  line: its values, in column order, as a compact JSON array. Values are encoded canonically,
  so the same row reads the same from SQLite and from PostgreSQL: NULL ``null``, an integer
  its decimal digits, a float the shortest text that reads back to the same double (``NaN``
  and ``Infinity`` as Python writes them), text a JSON string (not escaped to ASCII), bytes
  ``{"hex": "..."}``. A boolean is the integer 0 or 1, as SQLite stores it. Anything else is
  :class:`DigestError`: a value no store writes is never guessed at.
- An int and a float are different values (``1`` is not ``1.0``): a copy that changed a
  column's type is a mismatch, not a match.
- Two sides match when they hold the same tables, each with the same row count and digest.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from typing import Any

import attrs


class DigestError(ValueError):
    """A value the digest cannot encode; ``str()`` names the table and the column."""


@attrs.frozen
class TableDigest:
    """One table of one store, as read on one side: ``store`` is the store's label."""

    store: str
    table: str
    rows: int
    sha256: str


@attrs.frozen
class Mismatch:
    """A table whose copy differs from its source; ``sentence`` says how."""

    store: str
    table: str
    sentence: str


def encode_value(value: Any) -> Any:
    """``value`` as the JSON value its digest line holds (see the module's rules)."""
    if value is None or isinstance(value, str | float):
        return value
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        return {"hex": bytes(value).hex()}
    raise TypeError(type(value).__name__)


def row_line(row: Sequence[Any]) -> bytes:
    """One row as its digest line (UTF-8, newline-terminated)."""
    values = [encode_value(v) for v in row]
    text = json.dumps(values, ensure_ascii=False, separators=(",", ":"), allow_nan=True)
    return text.encode("utf-8") + b"\n"


class TableDigester:
    """Feed a table's rows in primary-key order with :meth:`add`; read :meth:`result`."""

    def __init__(self, store: str, table: str, columns: Sequence[str]) -> None:
        self._store = store
        self._table = table
        self._columns = tuple(columns)
        self._hash = hashlib.sha256()
        self._rows = 0

    def add(self, rows: Iterable[Sequence[Any]]) -> None:
        for row in rows:
            try:
                self._hash.update(row_line(row))
            except TypeError as exc:
                column = self._culprit(row)
                raise DigestError(
                    f"the {self._store} table {self._table} holds a value of type {exc} in "
                    f"column {column}, which no store writes; check that row with sqlite3 and "
                    "correct or remove it, then run migrate-store again."
                ) from None
            self._rows += 1

    def _culprit(self, row: Sequence[Any]) -> str:
        for name, value in zip(self._columns, row, strict=False):
            try:
                encode_value(value)
            except TypeError:
                return name
        return "(unknown)"

    def result(self) -> TableDigest:
        return TableDigest(self._store, self._table, self._rows, self._hash.hexdigest())


def digest_rows(
    store: str, table: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]
) -> TableDigest:
    """The digest of ``rows`` (already in primary-key order) in one call."""
    digester = TableDigester(store, table, columns)
    digester.add(rows)
    return digester.result()


def order_by(columns: Sequence[str], primary_key: Sequence[str]) -> str:
    """The ORDER BY clause both backends read a table's rows in for its digest: the primary
    key, else every column; NULLs first on both (PostgreSQL puts them last by default)."""
    keys = primary_key or columns
    return "ORDER BY " + ", ".join(f'"{c}" NULLS FIRST' for c in keys)


def compare(source: Sequence[TableDigest], target: Sequence[TableDigest]) -> list[Mismatch]:
    """Every table that differs between ``source`` and ``target``, in ``source``'s order then
    tables only the target has."""
    theirs = {(d.store, d.table): d for d in target}
    ours = {(d.store, d.table) for d in source}
    found: list[Mismatch] = []
    for mine in source:
        other = theirs.get((mine.store, mine.table))
        if other is None:
            found.append(Mismatch(mine.store, mine.table, f"the copy has no table {mine.table}"))
        elif other.rows != mine.rows:
            found.append(
                Mismatch(
                    mine.store,
                    mine.table,
                    f"the source has {_rows(mine.rows)} and the copy {other.rows}",
                )
            )
        elif other.sha256 != mine.sha256:
            found.append(
                Mismatch(
                    mine.store,
                    mine.table,
                    f"both have {_rows(mine.rows)} but their digests differ "
                    f"({mine.sha256[:16]} against {other.sha256[:16]}): some value changed",
                )
            )
    for extra in target:
        if (extra.store, extra.table) not in ours:
            found.append(
                Mismatch(extra.store, extra.table, f"only the copy has a table {extra.table}")
            )
    return found


def _rows(count: int) -> str:
    return f"{count} row" if count == 1 else f"{count} rows"


def report_lines(digests: Sequence[TableDigest], short: int = 16) -> list[str]:
    """The table ``migrate-store`` prints: store, table, rows and the first ``short`` hex
    digits of each digest, aligned."""
    header = ("store", "table", "rows", "sha256")
    body = [(d.store, d.table, str(d.rows), d.sha256[:short]) for d in digests]
    widths = [max(len(r[i]) for r in (header, *body)) for i in range(3)]
    lines = []
    for store, table, rows, digest in (header, *body):
        lines.append(f"  {store:<{widths[0]}}  {table:<{widths[1]}}  {rows:>{widths[2]}}  {digest}")
    return lines
