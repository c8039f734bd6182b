"""One Job from `tp submit` to exit, through a real coordinator and a real agent over TLS."""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.support import accounts
from tuneplane.coordinator.demo.cluster import LocalCluster

TERMINAL = {"succeeded", "failed", "aborted", "cancelled"}
# The coordinator's line for every MemberReport it receives (coordinator/gateways/node_messages.py).
REPORT_LINE = re.compile(r"member report node=\S+ journal=(\S+) seq=(\d+) run_id=(\S+)")


@pytest.fixture
def cluster(tmp_path: Path) -> Any:
    pool = accounts.cluster_pool(1)
    with LocalCluster(
        tmp_path / "cluster", heartbeat_interval=0.5, heartbeat_timeout=3, member_pool=pool,
        member_root=accounts.traversable_root("end_to_end"),
    ) as c:  # fmt: skip
        c.start_coordinator()
        c.add_agent("node-a", "h200:2")
        c.wait_connected()
        yield c


def _project(cluster: LocalCluster, root: Path, script: str) -> Path:
    root.mkdir()
    for args in (("init", str(root), "--name", "e2e"), ("new", "job", "--method", "custom/custom")):
        done = cluster.tp(*args, cwd=root)
        assert done.returncode == 0, done.stderr
    (root / "experiments" / "job" / "train.sh").write_text(script)
    return root


def _submit(cluster: LocalCluster, project: Path, profile: str = "h200:1") -> str:
    done = cluster.tp("submit", "job", "--profile", profile, "--yes", "--json", cwd=project)
    assert done.returncode == 0, done.stderr
    receipt = json.loads(done.stdout.strip().splitlines()[-1])
    return str(receipt["run_id"])


def _wait_terminal(cluster: LocalCluster, run_id: str, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        done = cluster.tp("job", "show", run_id, "--json")
        assert done.returncode == 0, done.stderr
        job: dict[str, Any] = json.loads(done.stdout)
        if job["state"] in TERMINAL or time.monotonic() > deadline:
            return job
        time.sleep(0.2)


def test_job_succeeds_with_exit_status_and_outputs(cluster: LocalCluster, tmp_path: Path) -> None:
    script = 'echo "hello from $TUNEPLANE_RUN_ID" > "$TUNEPLANE_OUT_DIR/result.txt"\nexit 0\n'
    project = _project(cluster, tmp_path / "proj", script)
    run_id = _submit(cluster, project)
    job = _wait_terminal(cluster, run_id)
    assert job["state"] == "succeeded", job
    states = [change["state"] for change in job["history"]]
    assert states[0] == "queued" and states[-1] == "succeeded"
    assert states.index("running") < states.index("succeeded")
    (member,) = job["attempts"][0]["members"]
    assert member["has_exit"] and member["exit_code"] == 0
    result = Path(member["out_dir"]) / "result.txt"
    assert result.read_text().strip() == f"hello from {run_id}"
    assert cluster.agents[0].out_root in result.parents


def test_job_exiting_non_zero_is_failed_with_its_exit_code(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    project = _project(cluster, tmp_path / "proj", "echo failing >&2\nexit 3\n")
    run_id = _submit(cluster, project)
    job = _wait_terminal(cluster, run_id)
    assert job["state"] == "failed", job
    (member,) = job["attempts"][0]["members"]
    assert member["has_exit"] and member["exit_code"] == 3
    listed = json.loads(cluster.tp("job", "ls", "--json").stdout)
    assert [j["state"] for j in listed if j["run_id"] == run_id] == ["failed"]


def test_each_report_of_a_launch_reaches_the_coordinator_once(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """A launch's reports (committed, starting, running, exited) each go out once: the session's
    tick must not send a report the member manager is about to publish (issue 13)."""
    project = _project(cluster, tmp_path / "proj", "exit 0\n")
    run_id = _submit(cluster, project)
    assert _wait_terminal(cluster, run_id)["state"] == "succeeded"
    # Stopped, the coordinator has logged every report it received.
    cluster.close()
    assert cluster.coordinator is not None
    received = Counter(
        (found[1], int(found[2]))
        for line in cluster.coordinator.log_path.read_text().splitlines()
        if (found := REPORT_LINE.search(line)) and found[3] == run_id
    )
    assert len(received) >= 4, received
    assert {key: n for key, n in received.items() if n > 1} == {}, received
