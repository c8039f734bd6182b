"""``tuneplane demo --slurm`` runs the demo's process-group Job on a throwaway Slurm cluster
through a Fleet of kind slurm, draws its train/loss curve from what the member's collector
shipped, stops every daemon and exits 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.slurm import require_slurm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DEMO = str(Path(sys.executable).with_name("tuneplane"))


def test_the_demo_runs_its_job_on_slurm_and_exits_0(tmp_path: Path) -> None:
    require_slurm()
    # subprocess.run kills the demo if it outlives its timeout.
    done = subprocess.run(
        [DEMO, "demo", "--slurm", "--workdir", str(tmp_path / "demo"), "--timeout", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
        timeout=280, check=False,
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, out
    assert "job succeeded — Slurm job" in out and "demo succeeded" in out
    assert "train/loss of run-" in out and "300 points" in out
    # Every daemon and the coordinator were stopped: nothing of the demo runs on.
    assert "still running" not in out
