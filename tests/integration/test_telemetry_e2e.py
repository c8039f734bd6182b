"""A real Job's metrics, written with tuneplane.report, reach `tp metrics` exactly once through
the real agent, the collector it starts, and the real telemetry gateway."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import pytest

from tests.support import accounts
from tests.support.processes import wait_until
from tuneplane.coordinator.demo.cluster import LocalCluster

SCRIPT = """env > "$TUNEPLANE_OUT_DIR/env.txt"
python3 - <<'PY'
from tuneplane.report import finish, init, log
init({"lr": 0.1})
for step in range(300):
    log({"train/loss": 1.0 / (step + 1), "train/lr": 0.1}, step=step)
finish()
PY
"""


@pytest.fixture
def cluster(tmp_path: Path) -> Any:
    pool = accounts.cluster_pool(1)
    with LocalCluster(
        tmp_path / "cluster", heartbeat_interval=0.5, heartbeat_timeout=3, member_pool=pool,
        member_root=accounts.traversable_root("telemetry_e2e"),
    ) as c:  # fmt: skip
        c.start_coordinator()
        c.add_agent("node-a", "h200:2")
        c.wait_connected()
        yield c


def _json(cluster: LocalCluster, *args: str) -> Any:
    done = cluster.tp(*args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_sdk_metrics_of_a_real_job_arrive_exactly_once(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    project = tmp_path / "proj"
    project.mkdir()
    for args in (
        ("init", str(project), "--name", "tel"),
        ("new", "job", "--method", "custom/custom"),
    ):
        assert cluster.tp(*args, cwd=project).returncode == 0
    (project / "experiments" / "job" / "train.sh").write_text(SCRIPT)
    done = cluster.tp("submit", "job", "--profile", "h200:1", "--yes", "--json", cwd=project)
    assert done.returncode == 0, done.stderr
    run_id = json.loads(done.stdout.strip().splitlines()[-1])["run_id"]

    job = wait_until(
        "the Job to succeed",
        lambda: (
            (j := _json(cluster, "job", "show", run_id))["state"] in ("succeeded", "failed") and j
        ),
        timeout=60,
    )
    assert job["state"] == "succeeded", job

    def drained() -> Any:
        members = _json(cluster, "metrics", run_id, "--delivery")["members"]
        return members if members and all(m["drained"] for m in members) else None

    (delivery,) = wait_until("the collector to deliver everything", drained, timeout=60)
    # Beside the files' 600 points, the collector's own process samples (source "system").
    system = _json(cluster, "metrics", run_id, "--raw", "--source", "system")["tags"]
    assert all(t["tag"].startswith("system/") for t in system)
    sampled = sum(t["points"] for t in system)
    assert delivery["points_stored"] == 600 + sampled and delivery["spool_points"] == 0
    tags = {t["tag"]: t for t in _json(cluster, "metrics", run_id)["tags"]}
    files = {name: t["points"] for name, t in tags.items() if not name.startswith("system/")}
    assert files == {"train/loss": 300, "train/lr": 300}
    series = _json(cluster, "metrics", run_id, "--tag", "train/loss", "--max-points", "1000")
    assert not series["downsampled"]
    assert [b["first_step"] for b in series["buckets"]] == list(range(300))
    assert [b["last"] for b in series["buckets"]] == [1.0 / (s + 1) for s in range(300)]

    # The credential lives in the Node's private directory, never where the workload looks.
    agent = cluster.agents[0]
    (credential,) = (agent.state_dir / "collectors").glob("*/credential")
    assert stat.S_IMODE(credential.stat().st_mode) == 0o600
    assert stat.S_IMODE(credential.parent.stat().st_mode) == 0o700
    out_dir = Path(job["attempts"][0]["members"][0]["out_dir"])
    env = (out_dir / "env.txt").read_text()
    assert f"TUNEPLANE_TELEMETRY_DIR={out_dir / 'telemetry'}" in env
    assert credential.read_text().strip() not in env and "tpn_" not in env
    chart = cluster.tp("metrics", run_id, "--tag", "train/loss")
    assert chart.returncode == 0 and "300 points" in chart.stdout
