"""The store on a real SQLite file: migrations in order, and the reservation key."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from tuneplane.coordinator.schema import LATEST_VERSION, MIGRATIONS
from tuneplane.coordinator.store import SchemaTooNew, Store


def _db_at_version(path: Path, version: int) -> None:
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for number, statements in MIGRATIONS:
        if number <= version:
            for sql in statements:
                db.execute(sql)
    db.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))
    db.commit()
    db.close()


def test_an_old_database_is_upgraded_in_order(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.db"
    _db_at_version(path, 1)
    db = sqlite3.connect(path)
    db.execute("INSERT INTO fleets (name, kind, created_at_ms) VALUES ('old', 'node', 1)")
    db.commit()
    db.close()

    async def go() -> tuple[int, list[str]]:
        store = await Store.open(path)
        try:
            return await store.schema_version(), await store.fleet_names()
        finally:
            await store.close()

    version, fleets = asyncio.run(go())
    assert version == LATEST_VERSION
    assert fleets == ["old"]


def test_a_newer_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.db"
    _db_at_version(path, LATEST_VERSION)
    db = sqlite3.connect(path)
    db.execute("UPDATE schema_version SET version = ?", (LATEST_VERSION + 1,))
    db.commit()
    db.close()
    with pytest.raises(SchemaTooNew, match="newer"):
        asyncio.run(Store.open(path))


def test_the_schema_makes_gpu_over_commit_impossible(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.db"
    _db_at_version(path, LATEST_VERSION)
    db = sqlite3.connect(path)
    row = "INSERT INTO reservations VALUES ('node-a', 0, ?, 1, 0, 1)"
    db.execute(row, ("run-1",))
    with pytest.raises(sqlite3.IntegrityError):
        db.execute(row, ("run-2",))
    db.close()


def test_migration_15_gives_existing_nodes_no_outputs_service(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.db"
    _db_at_version(path, 14)
    db = sqlite3.connect(path)
    db.execute("INSERT INTO fleets (name, kind, created_at_ms) VALUES ('default', 'node', 1)")
    db.execute(
        "INSERT INTO nodes (id, fleet, hostname, inventory_json, credential_hash, "
        "enrolled_at_ms, name, dialed_address) "
        "VALUES ('node-old', 'default', 'h', '{}', 'c', 1, 'h', '10.0.0.1:7444')"
    )
    db.commit()
    db.close()

    async def go() -> int:
        store = await Store.open(path)
        try:
            return await store.schema_version()
        finally:
            await store.close()

    assert asyncio.run(go()) == LATEST_VERSION
    db = sqlite3.connect(path)
    row = db.execute(
        "SELECT dialed_address, outputs_address, outputs_cert_sha256, outputs_grant_key "
        "FROM nodes WHERE id = 'node-old'"
    ).fetchone()
    db.close()
    assert row == ("10.0.0.1:7444", "", "", "")
