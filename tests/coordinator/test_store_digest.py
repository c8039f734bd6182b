"""The digest and compare logic of ``migrate-store`` (coordinator/store/digest.py): pure."""

from __future__ import annotations

import hashlib
from decimal import Decimal

import pytest

from tuneplane.coordinator.store.digest import (
    DigestError,
    TableDigest,
    TableDigester,
    compare,
    digest_rows,
    order_by,
    report_lines,
    row_line,
)

EMPTY = hashlib.sha256(b"").hexdigest()


def test_values_are_encoded_canonically() -> None:
    line = row_line([None, 3, 0.1, 'zürich "q"', b"\x00\xff", True, float("inf")])
    assert line == b'[null,3,0.1,"z\xc3\xbcrich \\"q\\"",{"hex":"00ff"},1,Infinity]\n'
    # Bytes read as bytes, bytearray or memoryview are one value.
    assert row_line([bytearray(b"ab")]) == row_line([memoryview(b"ab")]) == row_line([b"ab"])


def test_an_int_and_a_float_are_different_values() -> None:
    assert row_line([1]) != row_line([1.0])
    assert row_line(["1"]) != row_line([1])
    assert row_line([None]) != row_line(["null"])


def test_the_digest_is_sha256_over_the_lines_in_order() -> None:
    rows = [(1, "a"), (2, None)]
    found = digest_rows("store", "t", ["id", "name"], rows)
    assert found == TableDigest("store", "t", 2, hashlib.sha256(b'[1,"a"]\n[2,null]\n').hexdigest())
    assert digest_rows("store", "t", ["id", "name"], []).sha256 == EMPTY
    # Batches fed one after another give the digest of the whole.
    digester = TableDigester("store", "t", ["id", "name"])
    digester.add(rows[:1])
    digester.add(rows[1:])
    assert digester.result() == found
    assert digest_rows("store", "t", ["id", "name"], rows[::-1]).sha256 != found.sha256


def test_a_value_no_store_writes_is_refused_naming_table_and_column() -> None:
    with pytest.raises(DigestError) as caught:
        digest_rows("telemetry store", "metric_points", ["id", "value"], [(1, Decimal("1.5"))])
    assert "the telemetry store table metric_points" in str(caught.value)
    assert "type Decimal in column value" in str(caught.value)


def test_order_by_uses_the_primary_key_else_every_column_nulls_first() -> None:
    assert order_by(["a", "b", "c"], ["b", "a"]) == 'ORDER BY "b" NULLS FIRST, "a" NULLS FIRST'
    assert order_by(["a", "b"], []) == 'ORDER BY "a" NULLS FIRST, "b" NULLS FIRST'


def _d(table: str, rows: int, sha: str, store: str = "store") -> TableDigest:
    return TableDigest(store, table, rows, sha)


def test_compare_names_each_table_that_differs_and_how() -> None:
    source = [_d("jobs", 2, "a" * 64), _d("users", 1, "b" * 64), _d("nodes", 0, EMPTY)]
    assert compare(source, list(source)) == []
    target = [_d("jobs", 3, "a" * 64), _d("users", 1, "c" * 64), _d("extra", 0, EMPTY)]
    found = compare(source, target)
    assert [(m.table, m.sentence) for m in found] == [
        ("jobs", "the source has 2 rows and the copy 3"),
        (
            "users",
            "both have 1 row but their digests differ (bbbbbbbbbbbbbbbb against "
            "cccccccccccccccc): some value changed",
        ),
        ("nodes", "the copy has no table nodes"),
        ("extra", "only the copy has a table extra"),
    ]
    # The same table name in two stores is two tables.
    assert compare([_d("t", 0, EMPTY, "log store")], [_d("t", 0, EMPTY, "store")]) != []


def test_report_lines_align_store_table_rows_and_digest() -> None:
    lines = report_lines([_d("jobs", 12, "0123456789abcdef" * 4), _d("t", 3, EMPTY, "log store")])
    assert lines == [
        "  store      table  rows  sha256",
        "  store      jobs     12  0123456789abcdef",
        "  log store  t         3  e3b0c44298fc1c14",
    ]
