"""The store on a real database (SQLite and PostgreSQL): migrations in order, and the
reservation key."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.support.store_backend import current, open_at_version, read, write
from tuneplane.coordinator.store.core import SchemaTooNew, Store
from tuneplane.coordinator.store.handle import IntegrityViolation
from tuneplane.coordinator.store.schema import LATEST_VERSION
from tuneplane.coordinator.store_location import Where


def _at_version(path: Path, version: int) -> Where:
    """A store left at schema ``version`` by an older coordinator; where it is."""
    where = current().where(path)

    async def go() -> None:
        await (await open_at_version(Store, where, version)).close()

    asyncio.run(go())
    return where


def test_an_old_database_is_upgraded_in_order(tmp_path: Path) -> None:
    where = _at_version(tmp_path / "coordinator.db", 1)
    write(where, Store, "INSERT INTO fleets (name, kind, created_at_ms) VALUES ('old', 'node', 1)")

    async def go() -> tuple[int, list[str]]:
        store = await Store.open(where)
        try:
            return await store.schema_version(), await store.fleet_names()
        finally:
            await store.close()

    version, fleets = asyncio.run(go())
    assert version == LATEST_VERSION
    assert fleets == ["old"]


def test_a_newer_database_is_refused(tmp_path: Path) -> None:
    where = _at_version(tmp_path / "coordinator.db", LATEST_VERSION)
    write(where, Store, "UPDATE schema_version SET version = ?", (LATEST_VERSION + 1,))
    with pytest.raises(SchemaTooNew, match="newer"):
        asyncio.run(Store.open(where))


def test_the_schema_makes_gpu_over_commit_impossible(tmp_path: Path) -> None:
    where = _at_version(tmp_path / "coordinator.db", LATEST_VERSION)
    write(
        where, Store, "INSERT INTO fleets (name, kind, created_at_ms) VALUES ('default', 'node', 1)"
    )
    write(
        where,
        Store,
        "INSERT INTO nodes (id, fleet, hostname, inventory_json, credential_hash, enrolled_at_ms) "
        "VALUES ('node-a', 'default', 'h', '{}', 'c', 1)",
    )
    row = "INSERT INTO reservations VALUES ('node-a', 0, ?, 1, 0, 1)"

    async def go() -> None:
        store = await Store.open(where)
        try:
            for run_id in ("run-1", "run-2"):

                async def reserve(run_id: str = run_id) -> None:
                    async with store.transaction() as db:
                        await db.execute(row, (run_id,))

                if run_id == "run-1":
                    await store.shielded(reserve)
                    continue
                with pytest.raises(IntegrityViolation):
                    await store.shielded(reserve)
        finally:
            await store.close()

    asyncio.run(go())
    assert read(where, Store, "SELECT run_id FROM reservations") == [("run-1",)]


def test_migration_15_gives_existing_nodes_no_outputs_service(tmp_path: Path) -> None:
    where = _at_version(tmp_path / "coordinator.db", 14)
    write(
        where, Store, "INSERT INTO fleets (name, kind, created_at_ms) VALUES ('default', 'node', 1)"
    )
    write(
        where,
        Store,
        "INSERT INTO nodes (id, fleet, hostname, inventory_json, credential_hash, "
        "enrolled_at_ms, name, dialed_address) "
        "VALUES ('node-old', 'default', 'h', '{}', 'c', 1, 'h', '10.0.0.1:7444')",
    )

    async def go() -> int:
        store = await Store.open(where)
        try:
            return await store.schema_version()
        finally:
            await store.close()

    assert asyncio.run(go()) == LATEST_VERSION
    row = read(
        where,
        Store,
        "SELECT dialed_address, outputs_address, outputs_cert_sha256, outputs_grant_key "
        "FROM nodes WHERE id = 'node-old'",
    )
    assert row == [("10.0.0.1:7444", "", "", "")]
