"""Recipe parameters reach the workload: a real coordinator and Node run a process-group Job whose
ranks record their argv and TUNEPLANE_PARAM_* variables, and the test reads back what was
submitted; the preview shows the same command and environment first. A misspelled script is
refused at Preview, naming the closest file, and nothing is stored."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent.jobs import journal, tp, wait_job
from tests.faults.jobs import project
from tests.support.agent import AgentProcess, start_agent
from tests.support.coordinator import CoordinatorProcess, start_coordinator

pytestmark = pytest.mark.slow

# Each rank records exactly what it was started with: its argv after the interpreter, and every
# TUNEPLANE_PARAM_* variable.
TRAIN_PY = r"""
import json, os, sys
from pathlib import Path

rank = os.environ["RANK"]
seen = {
    "argv": sys.argv[1:],
    "params": {k: v for k, v in os.environ.items() if k.startswith("TUNEPLANE_PARAM_")},
}
(Path(os.environ["TUNEPLANE_OUT_DIR"]) / f"seen-{rank}.json").write_text(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def node(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[CoordinatorProcess, AgentProcess]]:
    root = tmp_path_factory.mktemp("params")
    with start_coordinator(root) as coord:
        agent = start_agent(root, coord, "node-a", "h200:2")
        try:
            agent.wait_connected()
            yield coord, agent
        finally:
            agent.stop()


def _tp_run(coord: CoordinatorProcess, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tuneplane.coordinator.cli.tp", "--context",
         str(coord.context_path), *args],
        cwd=cwd, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def _previews_stored(coord: CoordinatorProcess) -> int:
    with sqlite3.connect(coord.state_dir / "coordinator.db", timeout=10) as db:
        count: int = db.execute("SELECT count(*) FROM previews").fetchone()[0]
    return count


def test_ranks_get_the_submitted_parameters_as_flags_and_variables(
    node: tuple[CoordinatorProcess, AgentProcess], tmp_path: Path
) -> None:
    coord, agent = node
    root = project(coord, tmp_path / "proj", "pytorch/process-group", {"train.py": TRAIN_PY})
    params = ("--param", "steps=7", "--param", "learning_rate=2.5e-4")
    expected_argv = ["--steps", "7", "--learning_rate", "0.00025"]
    expected_env = {
        "TUNEPLANE_PARAM_LEARNING_RATE": "0.00025",
        "TUNEPLANE_PARAM_SCRIPT": "train.py",
        "TUNEPLANE_PARAM_STEPS": "7",
    }

    # The preview shows, before any Job exists, what each rank will run.
    shown = tp(coord, "submit", "job", "--profile", "h200:2", "--preview", *params, cwd=root)
    assert "Command        python3 train.py --steps 7 --learning_rate 0.00025" in shown, shown
    assert "TUNEPLANE_PARAM_STEPS=7" in shown and "TUNEPLANE_PARAM_SCRIPT=train.py" in shown
    out = tp(coord, "submit", "job", "--profile", "h200:2", "--yes", "--json", *params, cwd=root)
    preview, receipt = (json.loads(line) for line in out.strip().splitlines())
    assert preview["command"] == ["python3", "train.py", *expected_argv]
    assert {k: v for k, v in preview["env"].items() if k.startswith("TUNEPLANE_PARAM_")} == (
        expected_env
    )

    run_id = str(receipt["run_id"])
    done = wait_job(coord, run_id, 120)
    assert done["state"] == "succeeded", done
    members = [m for m in journal(agent, "members", "--json") if m["run_id"] == run_id]
    assert len(members) == 1
    out_dir = Path(members[0]["out_dir"])
    for rank in (0, 1):  # one local process per GPU, both with the same parameters
        seen = json.loads((out_dir / f"seen-{rank}.json").read_text())
        assert seen["argv"] == expected_argv
        assert seen["params"] == expected_env


def test_a_misspelled_script_is_refused_at_preview_naming_the_closest_file(
    node: tuple[CoordinatorProcess, AgentProcess], tmp_path: Path
) -> None:
    coord, _ = node
    root = project(coord, tmp_path / "proj", "pytorch/process-group", {"train.py": TRAIN_PY})
    before = _previews_stored(coord)
    done = _tp_run(
        coord, "submit", "job", "--profile", "h200:1", "--preview",
        "--param", "script=trian.py", cwd=root,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout
    assert "JobSpec field 'parameters.script' = 'trian.py'" in done.stderr, done.stderr
    assert "is not a file of experiment 'job'" in done.stderr
    assert "Did you mean 'train.py'?" in done.stderr
    # Nothing was stored: no preview on the coordinator, no preview file in the project.
    assert _previews_stored(coord) == before
    submissions = root / ".tuneplane-data" / "submissions"
    assert not submissions.exists() or not any(submissions.iterdir())


def test_the_starter_train_py_of_tp_new_reads_the_flags(
    node: tuple[CoordinatorProcess, AgentProcess], tmp_path: Path
) -> None:
    coord, agent = node
    root = project(coord, tmp_path / "proj", "pytorch/process-group", {})
    out = tp(
        coord, "submit", "job", "--profile", "h200:1", "--yes", "--json",
        "--param", "steps=5", "--param", "learning_rate=0.5", cwd=root,
    )  # fmt: skip
    run_id = str(json.loads(out.strip().splitlines()[-1])["run_id"])
    done = wait_job(coord, run_id, 120)
    assert done["state"] == "succeeded", done
    (member,) = [m for m in journal(agent, "members", "--json") if m["run_id"] == run_id]
    result = json.loads((Path(member["out_dir"]) / "rank-0.json").read_text())
    assert result["steps"] == 5 and result["learning_rate"] == 0.5
