"""Helpers for fault tests: projects for any recipe, submissions with a shape, Node views.

Everything goes through the real ``tp`` (see :mod:`tests.agent.jobs`); nothing here reaches into
a store or a journal except through the commands an operator would run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import psutil

from tests.agent.jobs import job, journal, tp
from tests.support.agent import AgentProcess, wait_until
from tests.support.coordinator import CoordinatorProcess


def project(coord: CoordinatorProcess, root: Path, method: str, files: dict[str, str]) -> Path:
    """A project with one experiment ``job`` of ``method`` holding ``files`` (name -> text)."""
    root.mkdir()
    tp(coord, "init", str(root), "--name", "faults", cwd=root)
    tp(coord, "new", "job", "--method", method, cwd=root)
    for name, text in files.items():
        (root / "experiments" / "job" / name).write_text(text)
    return root


def submit(coord: CoordinatorProcess, root: Path, profile: str, *extra: str) -> str:
    out = tp(coord, "submit", "job", "--profile", profile, "--yes", "--json", *extra, cwd=root)
    return str(json.loads(out.strip().splitlines()[-1])["run_id"])


def wait_state(coord: CoordinatorProcess, run_id: str, state: str, timeout: float = 30) -> Any:
    return wait_until(
        f"job {run_id} to be {state}",
        lambda: (j := job(coord, run_id))["state"] == state and j,
        timeout,
    )


def node(coord: CoordinatorProcess, node_id: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(tp(coord, "node", "show", node_id, "--json"))
    return data


def runner_alive(member_dir: Path) -> bool:
    """Whether the runner recorded in runner.json is alive with its recorded start time."""
    runner = json.loads((member_dir / "runner.json").read_text())
    try:
        proc = psutil.Process(int(runner["pid"]))
        return abs(proc.create_time() - float(runner["start_time"])) <= 1.0 and (
            proc.status() != psutil.STATUS_ZOMBIE
        )
    except psutil.Error:
        return False


def count_lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def held_gpus(agent: AgentProcess) -> list[dict[str, Any]]:
    """GPU ownership rows from the Node's journal (``tuneplane-node journal reservations``)."""
    rows: list[dict[str, Any]] = journal(agent, "reservations", "--json")["gpus"]
    return rows


def pending_reports(agent: AgentProcess) -> list[dict[str, Any]]:
    """Reports the Node journaled that no coordinator has acknowledged yet."""
    rows: list[dict[str, Any]] = journal(agent, "pending", "--json")
    return rows
