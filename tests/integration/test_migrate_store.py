"""`tuneplane-coordinator migrate-store`: a SQLite installation moved into PostgreSQL, for real.

A real coordinator and agent run a Job with metrics and logs on SQLite; serve stops; the stores
are copied into a fresh database on the embedded PostgreSQL server (tests/support/postgres.py);
serve starts again, now on PostgreSQL, and `tp` shows the same Job, metrics and logs. Each
refusal is checked like an attacker would: the refusal, and that nothing changed (the target's
rows, coordinator.toml, the SQLite files).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.integration.lifecycle_support import project, submit, wait_state
from tests.support import accounts
from tests.support.coordinator import start_coordinator
from tests.support.postgres import PostgresServer, run_async
from tests.support.postgres import postgres_server as postgres_server
from tests.support.processes import wait_until
from tests.support.store_backend import open_at_version
from tuneplane.coordinator.demo.cluster import LocalCluster
from tuneplane.coordinator.server.migrate_store import migrate
from tuneplane.coordinator.server.serve_lock import alone
from tuneplane.coordinator.store import migrate as store_migrate
from tuneplane.coordinator.store.digest import digest_rows, order_by
from tuneplane.coordinator.store.telemetry import TelemetryStore
from tuneplane.coordinator.store_location import parse_store_url

PASSWORD = "pw-never-shown-7f3a"
SCRIPT = """echo "training starts"
python3 - <<'PY'
from tuneplane.report import finish, init, log
init({"lr": 0.1})
for step in range(200):
    log({"train/loss": 1.0 / (step + 1)}, step=step)
finish()
PY
echo "training done" >&2
"""
SCHEMAS = ("tuneplane", "tuneplane_telemetry", "tuneplane_logs")
VERSION_TABLES = {"schema_version", "telemetry_schema_version", "logs_schema_version"}


def _admin(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tuneplane.coordinator.cli.admin", *args],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip


def _migrate(state_dir: Path, url: str) -> subprocess.CompletedProcess[str]:
    return _admin("migrate-store", "--state-dir", str(state_dir), "--to", url)


def _database(server: PostgresServer, password: str = "") -> str:
    """A fresh database's URL; with ``password`` in it (the embedded server trusts any)."""
    url = server.url(server.create_database())
    return url.replace("postgres:@", f"postgres:{password}@") if password else url


def _pg_fetch(url: str, sql: str) -> list[tuple[Any, ...]]:
    import asyncpg

    async def go() -> list[tuple[Any, ...]]:
        db = await asyncpg.connect(url)
        try:
            return [tuple(r) for r in await db.fetch(sql)]
        finally:
            await db.close()

    return run_async(go)


def _pg_tables(url: str) -> dict[str, int]:
    """Every table of the stores' schemas in the database and its row count."""
    names = _pg_fetch(
        url,
        "SELECT table_schema || '.' || table_name FROM information_schema.tables "
        f"WHERE table_schema IN {SCHEMAS!r} ORDER BY 1",
    )
    return {n: _pg_fetch(url, f"SELECT count(*) FROM {n}")[0][0] for (n,) in names}


def _sqlite_digests(state_dir: Path) -> dict[tuple[str, str], tuple[int, str]]:
    """Each store table's row count and digest, read from the SQLite files by hand."""
    found = {}
    for cls, name in store_migrate.STORES:
        with closing(sqlite3.connect(f"file:{state_dir / name}?mode=ro", uri=True)) as db:
            tables = [
                t for (t,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            ]
            for table in tables:
                if table == cls.VERSION_TABLE:
                    continue
                info = db.execute(f"SELECT name, pk FROM pragma_table_info('{table}')").fetchall()
                columns = [c for c, _ in info]
                key = [c for c, pk in sorted(info, key=lambda r: r[1]) if pk]
                quoted = ", ".join(f'"{c}"' for c in columns)
                rows = db.execute(f'SELECT {quoted} FROM "{table}" {order_by(columns, key)}')
                d = digest_rows(cls.LABEL, table, columns, rows)
                found[(cls.LABEL, table)] = (d.rows, d.sha256)
    return found


def _printed(out: str) -> dict[tuple[str, str], tuple[int, str]]:
    """The table migrate-store printed: (store, table) -> (rows, first 16 hex of sha256)."""
    found = {}
    for line in out.splitlines():
        match = re.match(r"^  (\w+(?: store)?)\s+(\w+)\s+(\d+)\s+([0-9a-f]{16})$", line)
        if match:
            found[(match[1], match[2])] = (int(match[3]), match[4])
    return found


def _files(state_dir: Path) -> dict[str, str]:
    """The SQLite files and coordinator.toml by content digest (WAL files included)."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(state_dir.iterdir())
        if p.is_file() and (p.suffix in (".db", ".toml") or p.name.endswith(("-wal", "-shm")))
    }


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    pool = accounts.cluster_pool(1)
    with LocalCluster(
        tmp_path / "cluster", heartbeat_interval=0.5, heartbeat_timeout=3, member_pool=pool,
        member_root=accounts.traversable_root("migrate_store"),
    ) as c:  # fmt: skip
        c.start_coordinator()
        c.add_agent("node-a", "h200:2")
        c.wait_connected()
        yield c


def _tp_json(cluster: LocalCluster, *args: str) -> Any:
    done = cluster.tp(*args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _views(cluster: LocalCluster, run_id: str) -> dict[str, Any]:
    """What a researcher sees of the Job: its record, its metrics, its logs."""
    logs = cluster.tp("logs", run_id, "--stdout")
    assert logs.returncode == 0, logs.stderr
    return {
        "job": _tp_json(cluster, "job", "show", run_id),
        "tags": _tp_json(cluster, "metrics", run_id),
        "loss": _tp_json(cluster, "metrics", run_id, "--tag", "train/loss"),
        "logs": logs.stdout,
    }


def test_a_sqlite_installation_moves_to_postgresql_and_serves_the_same_job(
    cluster: LocalCluster, tmp_path: Path, postgres_server: PostgresServer
) -> None:
    run_id = submit(cluster, project(cluster, tmp_path / "proj", SCRIPT))
    assert wait_state(cluster, run_id, "succeeded", "failed")["state"] == "succeeded"

    def drained() -> bool:
        members = _tp_json(cluster, "metrics", run_id, "--delivery")["members"]
        return bool(members) and all(m["drained"] for m in members)

    wait_until("the collector to deliver every point", drained, timeout=60)
    wait_until(
        "the logs to arrive",
        lambda: "training starts" in cluster.tp("logs", run_id, "--stdout").stdout,
    )
    before = _views(cluster, run_id)
    assert before["loss"]["total_points"] == 200 and "training starts" in before["logs"]
    for agent in cluster.agents:
        agent.process.stop()
    assert cluster.coordinator is not None
    assert cluster.coordinator.stop() == 0
    state = cluster.coordinator_dir
    expected = _sqlite_digests(state)
    assert all(expected[(label, t)][0] > 0 for label, t in [
        ("store", "jobs"), ("telemetry store", "metric_points"), ("log store", "log_chunks"),
    ])  # fmt: skip

    url = _database(postgres_server, PASSWORD)
    done = _migrate(state, url)
    assert done.returncode == 0, done.stderr
    assert PASSWORD not in done.stdout + done.stderr
    printed = _printed(done.stdout)
    assert printed == {k: (rows, sha[:16]) for k, (rows, sha) in expected.items()}
    assert done.stdout.rstrip().splitlines()[-1].endswith("; verified.")
    assert "frozen copy" in done.stdout and "the next `serve` uses PostgreSQL" in done.stdout
    # The target holds exactly the rows SQLite held.
    counts = _pg_tables(url)
    schemas = {cls.LABEL: cls.SCHEMA for cls, _ in store_migrate.STORES}
    for (label, table), (rows, _digest) in expected.items():
        assert counts[f"{schemas[label]}.{table}"] == rows, (label, table)
    config = state / "coordinator.toml"
    assert config.stat().st_mode & 0o777 == 0o600  # the URL carries a password
    assert parse_store_url(url, "test").dsn() in config.read_text()
    frozen = {k: v for k, v in _files(state).items() if k.endswith(".db")}

    # serve again: now on PostgreSQL, the same Job, metrics and logs.
    cluster.start_coordinator()
    after = _views(cluster, run_id)
    assert after["job"] == before["job"]
    assert after["tags"] == before["tags"]
    assert after["loss"] == before["loss"]
    assert after["logs"] == before["logs"]
    # A new decision numbers on past the copied ones (the identity column was moved on).
    old_ids = [json.loads(line)["id"] for line in _decisions(state)]
    node_id = cluster.agents[0].node_id
    assert cluster.tp("node", "cordon", node_id, "--reason", "moved").returncode == 0
    new_ids = [json.loads(line)["id"] for line in _decisions(state)]
    assert new_ids[: len(old_ids)] == old_ids and min(new_ids[len(old_ids) :]) > max(old_ids)
    # The SQLite files are a frozen copy: serve on PostgreSQL wrote none of them.
    assert {k: v for k, v in _files(state).items() if k.endswith(".db")} == frozen
    assert PASSWORD not in (cluster.root / "logs" / "coordinator.log").read_text()


def _decisions(state_dir: Path) -> list[str]:
    done = _admin("decisions", "--state-dir", str(state_dir), "--json")
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.fixture
def sqlite_state(tmp_path: Path) -> Path:
    """A SQLite coordinator that served once (all three store files exist), now stopped."""
    with start_coordinator(tmp_path) as coordinator:
        state = coordinator.state_dir
    return state


def test_refusals_change_nothing(
    sqlite_state: Path, tmp_path: Path, postgres_server: PostgresServer
) -> None:
    state = sqlite_state
    files = _files(state)
    empty = _database(postgres_server)

    # A URL that is no PostgreSQL URL: refused before anything is read.
    bad = _migrate(state, "sqlite:///var/lib/tuneplane/coordinator.db")
    assert bad.returncode == 2 and "only a PostgreSQL database" in bad.stderr

    # A serve running on the state directory.
    with start_coordinator(tmp_path) as coordinator:
        pid = coordinator.pid
        running = _migrate(state, empty)
        assert running.returncode == 1
        assert f"A coordinator serve (pid {pid}) is running on {state}" in running.stderr
        assert "Stop it" in running.stderr and "Nothing was changed" in running.stderr
    assert _pg_tables(empty) == {}

    # A target whose stores already hold rows (another installation's).
    other = tmp_path / "other"
    assert _admin("init", "--state-dir", str(other)).returncode == 0
    full = _database(postgres_server)
    assert _migrate(other, full).returncode == 0
    held = _pg_tables(full)
    refused = _migrate(state, full)
    assert refused.returncode == 1
    assert "already holds a coordinator's rows (tuneplane.decisions" in refused.stderr
    assert "DROP SCHEMA tuneplane, tuneplane_telemetry, tuneplane_logs CASCADE" in refused.stderr
    assert _pg_tables(full) == held

    # A state directory already on PostgreSQL.
    other_files = _files(other)
    again = _migrate(other, empty)
    assert again.returncode == 1 and "already in PostgreSQL" in again.stderr
    assert _files(other) == other_files

    assert _pg_tables(empty) == {}
    assert _files(state) == files


def test_serve_refuses_to_start_while_migrate_store_holds_the_directory(
    sqlite_state: Path, tmp_path: Path
) -> None:
    with alone(sqlite_state, "migrate-store"):
        started = _admin("serve", "--state-dir", str(sqlite_state), "--api-port", "0",
                         "--control-port", "0", "--telemetry-port", "0")  # fmt: skip
    assert started.returncode == 1
    assert f"`tuneplane-coordinator migrate-store` (pid {os.getpid()}) holds" in started.stderr
    assert not (sqlite_state / "endpoints.json").exists()


def test_an_older_source_is_migrated_first_and_a_missing_file_copied_empty(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    state = tmp_path / "coordinator"
    assert _admin("init", "--state-dir", str(state)).returncode == 0
    older = TelemetryStore.MIGRATIONS[-2][0]

    async def make_older() -> None:
        store = await open_at_version(TelemetryStore, state / "telemetry.db", older)
        await store.close()

    anyio.run(make_older)
    url = _database(postgres_server)
    done = _migrate(state, url)
    assert done.returncode == 0, done.stderr
    latest = TelemetryStore.MIGRATIONS[-1][0]
    assert (
        f"The telemetry store telemetry.db was at schema version {older}; opening it migrated "
        f"it to {latest} before the copy." in done.stdout
    )
    assert "The log store has no file yet (logs.db" in done.stdout
    assert not (state / "logs.db").exists()
    assert _pg_tables(url)["tuneplane_logs.log_chunks"] == 0


def test_a_value_postgresql_cannot_hold_keeps_nothing_of_any_store(
    sqlite_state: Path, postgres_server: PostgresServer
) -> None:
    """The telemetry store (copied second) fails: the store's rows, copied first, go too."""
    with closing(sqlite3.connect(sqlite_state / "telemetry.db")) as db, db:
        db.execute(
            "INSERT INTO collector_credentials (token_hash, run_id, attempt, member_index, "
            "node_id, issued_at_ms, expires_at_ms) VALUES (?, ?, 1, 0, 'n', 1, 1)",
            ("h", "run-\x00-nul"),
        )
    files = _files(sqlite_state)
    url = _database(postgres_server)
    done = _migrate(sqlite_state, url)
    assert done.returncode == 1
    assert "Copying the telemetry store table collector_credentials into" in done.stderr
    assert "nothing of any store was kept there" in done.stderr
    held = {t: n for t, n in _pg_tables(url).items() if t.split(".")[1] not in VERSION_TABLES}
    assert held and all(rows == 0 for rows in held.values()), held
    assert _files(sqlite_state) == files


def test_a_copy_that_differs_is_reported_and_not_recorded(
    sqlite_state: Path, postgres_server: PostgresServer
) -> None:
    """Another writer changes the target between the copy and the check."""
    url = _database(postgres_server)
    config = (sqlite_state / "coordinator.toml").read_text()

    def say(text: str) -> None:
        if text.startswith("Copied "):
            _pg_fetch(url, "UPDATE tuneplane.users SET role = 'tampered' RETURNING 1")

    target = parse_store_url(url, "test")
    with pytest.raises(store_migrate.Mismatched) as caught:
        anyio.run(migrate, sqlite_state, target, say)
    (found,) = caught.value.mismatches
    assert (found.store, found.table) == ("store", "users")
    assert "their digests differ" in found.sentence
    assert "the store table users" in str(caught.value)
    assert "DROP SCHEMA" in str(caught.value)
    assert (sqlite_state / "coordinator.toml").read_text() == config
