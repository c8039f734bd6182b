"""A launch that fails on its Node ends the attempt (issue 8, Must 10), with real processes.

A real coordinator and agent on loopback TLS, `tp` as a child process. The failure is a real one
an operator can cause: the agent's out root replaced by a plain file after it started, so the
member's ``$TUNEPLANE_OUT_DIR`` cannot be made. The Job must end with the Node's sentence, its
GPUs must be free on both sides, and once the out root is fixed `tp job retry` must succeed.
"""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent.jobs import TERMINAL, job, submit, tp, wait_job
from tests.faults.jobs import wait_state
from tests.support.agent import AgentProcess, node_cli, start_agent
from tests.support.coordinator import CoordinatorProcess, start_coordinator

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def node(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[CoordinatorProcess, AgentProcess]]:
    root = tmp_path_factory.mktemp("launch")
    with start_coordinator(root) as coord:
        agent = start_agent(root, coord, "node-a")
        try:
            agent.wait_connected()
            yield coord, agent
        finally:
            agent.stop()


def reserved_gpus(coord: CoordinatorProcess, run_id: str) -> list[int]:
    path = coord.state_dir / "coordinator.db"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        rows = db.execute("SELECT gpu_index FROM reservations WHERE run_id = ?", (run_id,))
        return [int(r[0]) for r in rows]


def owned_gpus(agent: AgentProcess) -> list[int]:
    with sqlite3.connect(f"file:{agent.journal_path}?mode=ro", uri=True) as db:
        return [int(r[0]) for r in db.execute("SELECT gpu_index FROM gpu_ownership")]


def test_a_launch_that_fails_on_the_node_ends_the_job_frees_its_gpus_and_a_retry_works(
    node: tuple[CoordinatorProcess, AgentProcess], tmp_path: Path
) -> None:
    coord, agent = node
    out_root = agent.out_root
    shutil.rmtree(out_root, ignore_errors=True)
    out_root.write_text("not a directory\n")  # as a mount gone wrong would leave it
    try:
        run_id = submit(coord, tmp_path / "proj", 'echo ran > "$TUNEPLANE_OUT_DIR/ran"\n')
        ended = wait_job(coord, run_id, timeout=60)
    finally:
        out_root.unlink()
        out_root.mkdir()
    assert ended["state"] in ("failed", "aborted"), ended
    assert ended["state_reason"].startswith("member 0 could not be started on its Node: "), ended
    assert "Not a directory" in ended["state_reason"]
    assert f"tp job retry {run_id}" in ended["state_reason"]
    (member,) = ended["attempts"][-1]["members"]
    assert member["state"] == "aborted"
    assert reserved_gpus(coord, run_id) == []
    assert owned_gpus(agent) == []

    tp(coord, "job", "retry", run_id)
    done = wait_state(coord, run_id, "succeeded", timeout=60)
    assert len(done["attempts"]) == 2
    assert (out_root / run_id / "attempt-2" / "member-0" / "ran").read_text() == "ran\n"
    assert reserved_gpus(coord, run_id) == []
    assert job(coord, run_id)["state"] in TERMINAL


def test_the_agent_refuses_a_relative_state_dir_with_a_sentence(tmp_path: Path) -> None:
    done = subprocess.run(
        node_cli("run", "--state-dir", "relative/state"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done
    assert "--state-dir relative/state is a relative path" in done.stderr
    assert f"--state-dir {tmp_path / 'relative' / 'state'}" in done.stderr
    assert not (tmp_path / "relative").exists()
