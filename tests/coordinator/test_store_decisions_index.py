"""Migration 20: one Job's decisions are read along an index on (run_id, id), on SQLite and on
PostgreSQL (tests/coordinator/conftest.py runs this module on both).

A store left at version 19 with decisions in it is migrated: its rows are kept, the index is
there, the Job page's read (``JOB_DECISIONS_SQL``) is planned along it rather than as a scan of
the whole log, and it answers that Job's newest rows, oldest first.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.postgres import run_async
from tests.support.store_backend import StoreBackend, open_at_version, read, write
from tuneplane.coordinator.store.core import Store
from tuneplane.coordinator.store.decision_log import JOB_DECISIONS_SQL, job_decisions
from tuneplane.coordinator.store.sql import to_postgres
from tuneplane.coordinator.store_location import PostgresUrl, Where

pytestmark = pytest.mark.timeout(120)

INDEX = "decisions_by_run"


def _plan(where: Where) -> str:
    """How the backend plans the Job page's read of run-a's decisions, as text. PostgreSQL is
    told to avoid sequential scans, as its planner would for a long log: a table of a few rows
    is cheaper to scan, which says nothing about the index."""
    if not isinstance(where, PostgresUrl):
        rows = read(where, Store, f"EXPLAIN QUERY PLAN {JOB_DECISIONS_SQL}", ("run-a", 3))
        return " ".join(str(r[-1]) for r in rows)
    import asyncpg

    async def go() -> list[Any]:
        db = await asyncpg.connect(where.dsn(), server_settings={"search_path": Store.SCHEMA})
        try:
            await db.execute("SET enable_seqscan = off")
            return list(await db.fetch(f"EXPLAIN {to_postgres(JOB_DECISIONS_SQL)}", "run-a", 3))
        finally:
            await db.close()

    return " ".join(str(r[0]) for r in run_async(go))


def _run_indexes(where: Where) -> list[str]:
    """The decisions table's index definitions that involve run_id (PostgreSQL also lists its
    primary key's)."""
    if isinstance(where, PostgresUrl):
        sql = "SELECT indexdef FROM pg_indexes WHERE schemaname = ? AND tablename = 'decisions'"
        found = [str(r[0]) for r in read(where, Store, sql, (Store.SCHEMA,))]
    else:
        sql = "SELECT sql FROM sqlite_master WHERE type = 'index' AND tbl_name = 'decisions'"
        found = [str(r[0]) for r in read(where, Store, sql)]
    return [d for d in found if "run_id" in d]


def test_an_old_store_gets_the_index_and_the_job_page_reads_along_it(
    store_backend: StoreBackend, tmp_path: Path
) -> None:
    where = store_backend.where(tmp_path / "coordinator.db")

    async def old() -> None:
        store = await open_at_version(Store, where, 19)
        await store.close()

    asyncio.run(old())
    assert _run_indexes(where) == []
    for i in range(12):
        write(
            where,
            Store,
            "INSERT INTO decisions (at_ms, kind, run_id, detail_json) VALUES (?, ?, ?, ?)",
            (1000 + i, "state", "run-a" if i % 3 else "run-b", json.dumps({"n": i})),
        )

    async def migrated() -> tuple[int, tuple[list[Any], bool]]:
        store = await Store.open(where)
        try:
            return await store.schema_version(), await job_decisions(store, "run-a", 3)
        finally:
            await store.close()

    version, (rows, older) = asyncio.run(migrated())
    assert version >= 20  # and any migration after it
    (index,) = _run_indexes(where)
    assert INDEX in index and "(run_id, id)" in index
    plan = _plan(where)
    assert INDEX in plan, plan
    assert "SCAN decisions" not in plan and "Seq Scan" not in plan, plan
    # Run-a's newest three of its eight rows, oldest first; older ones exist.
    assert [r.detail["n"] for r in rows] == [8, 10, 11] and older is True
    assert read(where, Store, "SELECT COUNT(*) FROM decisions") == [(12,)]
