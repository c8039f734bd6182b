"""Helpers for agent tests that need a Job: the real `tp` against a real coordinator."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.support.agent import AgentProcess, wait_until
from tests.support.coordinator import CoordinatorProcess

TERMINAL = {"succeeded", "failed", "aborted", "cancelled"}


def tp(
    coord: CoordinatorProcess, *args: str, cwd: Path | None = None, prefix: Sequence[str] = ()
) -> str:
    """The real ``tp`` against ``coord``; ``prefix`` runs it on another host (a network
    namespace's ``host.prefix()``: the host whose name tp-context.json gives)."""
    done = subprocess.run(
        [*prefix, sys.executable, "-m", "tuneplane.coordinator.cli.tp", "--context",
         str(coord.context_path), *args],
        cwd=cwd, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def submit(coord: CoordinatorProcess, root: Path, script: str) -> str:
    """A custom/custom Job of one member running ``script``; returns its run id."""
    root.mkdir()
    tp(coord, "init", str(root), "--name", "agent", cwd=root)
    tp(coord, "new", "job", "--method", "custom/custom", cwd=root)
    (root / "experiments" / "job" / "train.sh").write_text(script)
    out = tp(coord, "submit", "job", "--profile", "h200:1", "--yes", "--json", cwd=root)
    return str(json.loads(out.strip().splitlines()[-1])["run_id"])


def job(coord: CoordinatorProcess, run_id: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(tp(coord, "job", "show", run_id, "--json"))
    return data


def wait_job(coord: CoordinatorProcess, run_id: str, timeout: float = 60) -> dict[str, Any]:
    result: dict[str, Any] = wait_until(
        f"job {run_id} to end", lambda: (j := job(coord, run_id))["state"] in TERMINAL and j,
        timeout,
    )  # fmt: skip
    return result


def journal(agent: AgentProcess, *args: str) -> Any:
    done = agent.cli("journal", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout) if "--json" in args else done.stdout
