"""Helpers for the Job lifecycle tests: a project per workload, submit, and wait on `tp` output.

Rules: everything goes through the real ``tp`` against a real LocalCluster; waits poll with a
deadline and fail naming what they waited for.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tuneplane.coordinator.demo.cluster import LocalCluster

TERMINAL = {"succeeded", "failed", "aborted", "cancelled"}


def project(cluster: LocalCluster, root: Path, script: str, grace_period_s: int = 2) -> Path:
    """A project under ``root`` with one custom experiment ``job`` running ``script``."""
    root.mkdir()
    for args in (
        ("init", str(root), "--name", root.name),
        ("new", "job", "--method", "custom/custom"),
    ):
        done = cluster.tp(*args, cwd=root)
        assert done.returncode == 0, done.stderr
    experiment = root / "experiments" / "job"
    (experiment / "train.sh").write_text(script)
    config = experiment / "config.yaml"
    text = re.sub(
        r"(?m)^grace_period_s: \d+$", f"grace_period_s: {grace_period_s}", config.read_text()
    )
    assert f"grace_period_s: {grace_period_s}" in text, text
    config.write_text(text)
    return root


def submit(cluster: LocalCluster, root: Path, *extra: str, profile: str = "h200:1") -> str:
    done = cluster.tp("submit", "job", "--profile", profile, *extra, "--yes", "--json", cwd=root)
    assert done.returncode == 0, done.stderr
    return str(json.loads(done.stdout.strip().splitlines()[-1])["run_id"])


def show(cluster: LocalCluster, run_id: str) -> dict[str, Any]:
    done = cluster.tp("job", "show", run_id, "--json")
    assert done.returncode == 0, done.stderr
    job: dict[str, Any] = json.loads(done.stdout)
    return job


def wait_job(
    cluster: LocalCluster,
    run_id: str,
    what: str,
    check: Callable[[dict[str, Any]], bool],
    timeout: float = 60,
) -> dict[str, Any]:
    """Poll ``tp job show`` until ``check(job)``; fail with the last view after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        job = show(cluster, run_id)
        if check(job):
            return job
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; the Job is now:\n{job}")
        time.sleep(0.2)


def wait_state(
    cluster: LocalCluster, run_id: str, *states: str, timeout: float = 60
) -> dict[str, Any]:
    return wait_job(
        cluster, run_id, f"{run_id} to be {' or '.join(states)}", lambda j: j["state"] in states,
        timeout,
    )  # fmt: skip


def member_running(job: dict[str, Any], index: int = 0) -> bool:
    attempts = job["attempts"]
    return bool(attempts) and attempts[-1]["members"][index]["state"] == "running"
