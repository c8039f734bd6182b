"""A failed Job's cause (its first failed member and that member's stderr) is read only by those
who may read the Job, tried with real parts: a real coordinator, a real agent running alice's
real workload, and the real ``tp`` run as alice and as bob.

bob is refused the view, the JSON, ``tp logs`` (whose default now asks the Job which member
failed) and ``tp logs --follow``; none of his answers holds a byte of alice's stderr, and the
refusals change nothing (Job states, reservations, stored log bytes, the decision log).
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from tests.cli.tp_process import run_tp_as
from tests.support.agent import AgentProcess, start_agent, wait_until
from tests.support.coordinator import CoordinatorProcess, start_coordinator

pytestmark = pytest.mark.slow

SECRET = "alice-secret-token-9f2c"
SCRIPT = f'echo "using {SECRET}" >&2\nexit 3\n'


def _tp(
    coord: CoordinatorProcess, token: Path, *args: str, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return run_tp_as(coord, token, *args, cwd=cwd)


def _ok(coord: CoordinatorProcess, token: Path, *args: str, cwd: Path | None = None) -> str:
    done = _tp(coord, token, *args, cwd=cwd)
    assert done.returncode == 0, f"tp {' '.join(args)}: {done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def world(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[CoordinatorProcess, dict[str, Path], str]]:
    root = tmp_path_factory.mktemp("cause-access")
    with start_coordinator(root) as coord:
        agent: AgentProcess = start_agent(root, coord, "node-a", "h200:1")
        try:
            agent.wait_connected()
            tokens = {name: coord.user_token_file(name) for name in ("alice", "bob")}
            project = root / "alice-project"
            project.mkdir()
            _ok(coord, tokens["alice"], "init", str(project), "--name", "secret", cwd=project)
            _ok(coord, tokens["alice"], "new", "job", "--method", "custom/custom", cwd=project)
            (project / "experiments" / "job" / "train.sh").write_text(SCRIPT)
            out = _ok(
                coord, tokens["alice"], "submit", "job", "--profile", "h200:1", "--yes",
                "--json", cwd=project,
            )  # fmt: skip
            run_id = str(json.loads(out.strip().splitlines()[-1])["run_id"])

            def cause_stored() -> bool:
                view = json.loads(_ok(coord, tokens["alice"], "job", "show", run_id, "--json"))
                failure = view.get("first_failure") or {}
                return view["state"] == "failed" and SECRET in failure.get("stderr_tail", "")

            wait_until("alice's Job to fail with its stderr stored", cause_stored, 60)
            yield coord, tokens, run_id
        finally:
            agent.stop()


def _snapshot(coord: CoordinatorProcess) -> dict[str, Any]:
    def rows(db_name: str, sql: str) -> list[tuple[Any, ...]]:
        path = coord.state_dir / db_name
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)) as db:
            return sorted(tuple(r) for r in db.execute(sql).fetchall())

    return {
        "jobs": rows("coordinator.db", "SELECT run_id, state, updated_at_ms FROM jobs"),
        "members": rows(
            "coordinator.db", "SELECT run_id, member_index, state, ended_at_ms FROM members"
        ),
        "decisions": rows("coordinator.db", "SELECT COUNT(*) FROM decisions"),
        "gpus": rows("coordinator.db", "SELECT node_id, gpu_index, run_id FROM reservations"),
        "logs": rows("logs.db", "SELECT run_id, stream, next_offset, kept_bytes FROM log_streams"),
    }


def test_another_user_never_sees_the_cause_and_nothing_changes(
    world: tuple[CoordinatorProcess, dict[str, Path], str],
) -> None:
    coord, tokens, run_id = world
    before = _snapshot(coord)
    for args in (
        ("job", "show", run_id),
        ("job", "show", run_id, "--json"),
        ("logs", run_id),
        ("logs", run_id, "--follow", "--interval", "0.2"),
        ("logs", run_id, "--member", "0", "--stderr"),
    ):
        done = _tp(coord, tokens["bob"], *args)
        assert done.returncode == 1, f"tp {' '.join(args)} as bob was allowed: {done.stdout}"
        assert "belongs to alice" in done.stderr and "does not share it with bob" in done.stderr
        assert SECRET not in done.stdout + done.stderr
        assert "Traceback" not in done.stderr
    assert _snapshot(coord) == before


def test_the_owner_sees_the_cause(world: tuple[CoordinatorProcess, dict[str, Path], str]) -> None:
    coord, tokens, run_id = world
    assert f"using {SECRET}" in _ok(coord, tokens["alice"], "job", "show", run_id)
    assert _ok(coord, tokens["alice"], "logs", run_id) == f"using {SECRET}\n"
