"""The demo's bundled example project: its locks are current and its programs really work."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from tuneplane.coordinator.catalogue import Catalogue
from tuneplane.coordinator.cli.intent import SubmitRequest, build_jobspec
from tuneplane.coordinator.cli.project import LOCK_FILE, RecipeLock, find_project
from tuneplane.coordinator.cli.scaffold import config_text
from tuneplane.proto.contract import jobspec

CATALOGUE = Catalogue.bundled()
EXPECTED = {"hello": "custom/custom", "allreduce": "pytorch/process-group"}


@pytest.fixture(scope="module")
def example() -> Path:
    root = resources.files("tuneplane.coordinator.demo") / "example"
    path = Path(str(root))
    assert (path / "tuneplane.yaml").is_file()
    return path


def test_project_and_experiments(example: Path) -> None:
    project = find_project(example / "experiments" / "hello")
    assert project.name == "demo"
    assert project.experiments() == sorted(EXPECTED)


@pytest.mark.parametrize("experiment", sorted(EXPECTED))
def test_locks_are_what_tp_new_writes_today(example: Path, experiment: str) -> None:
    recipe = CATALOGUE.recipes[EXPECTED[experiment]]
    lock_text = (example / "experiments" / experiment / LOCK_FILE).read_text()
    # Byte for byte: if the Catalogue changes, this fails until the locks are upgraded.
    assert lock_text == RecipeLock.of(recipe).to_json()


@pytest.mark.parametrize("experiment", sorted(EXPECTED))
def test_experiments_build_valid_jobspecs(example: Path, experiment: str) -> None:
    project = find_project(example)
    spec = build_jobspec(project, SubmitRequest(experiment, profile="h200:4"), CATALOGUE)
    assert jobspec.loads(jobspec.canonical_json(spec)) == spec


def test_hello_config_is_the_generated_one(example: Path) -> None:
    text = (example / "experiments" / "hello" / "config.yaml").read_text()
    assert text == config_text("hello", CATALOGUE.recipes["custom/custom"])


def test_hello_writes_into_the_out_dir(example: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    done = subprocess.run(
        ["bash", str(example / "experiments" / "hello" / "train.sh")],
        cwd=tmp_path,
        env=dict(os.environ, TUNEPLANE_OUT_DIR=str(out)),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "hello from experiment hello" in done.stdout
    assert (out / "hello.txt").read_text().startswith("hello from ")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_allreduce_ranks_meet_over_tcp(example: Path, tmp_path: Path) -> None:
    world = 3
    port = _free_port()
    script = example / "experiments" / "allreduce" / "train.py"
    procs = []
    # Highest rank first: the peers must wait for rank 0 rather than rely on start order.
    for rank in reversed(range(world)):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            TUNEPLANE_OUT_DIR=str(tmp_path),
            ALLREDUCE_TIMEOUT_S="30",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * world, outputs
    for rank in range(world):
        result = json.loads((tmp_path / f"allreduce-rank-{rank}.json").read_text())
        assert result == {"rank": rank, "world_size": world, "sum": 3, "ok": True}


def test_allreduce_fails_when_a_rank_is_missing(example: Path, tmp_path: Path) -> None:
    env = dict(
        os.environ,
        RANK="0",
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        TUNEPLANE_OUT_DIR=str(tmp_path),
        ALLREDUCE_TIMEOUT_S="0.5",
    )
    script = example / "experiments" / "allreduce" / "train.py"
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, timeout=30, check=False
    )
    assert done.returncode != 0
    assert not (tmp_path / "allreduce-rank-0.json").exists()
