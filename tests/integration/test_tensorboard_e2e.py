"""A real Job that writes TensorBoard event files where its own configuration says, and
tuneplane.report files beside them, gets its curves in `tp metrics` with no wrapper: through
the real agent, the variables it sets, and the collector following the whole output directory."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from tests.collector.tb_writers import tensorboard_scalars, write_simple
from tests.support import accounts
from tests.support.processes import wait_until
from tuneplane.coordinator.demo.cluster import LocalCluster

STEPS = 50


@pytest.fixture
def cluster(tmp_path: Path) -> Any:
    pool = accounts.cluster_pool(1)
    with LocalCluster(
        tmp_path / "cluster", heartbeat_interval=0.5, heartbeat_timeout=3, member_pool=pool,
        member_root=accounts.traversable_root("tensorboard_e2e"),
    ) as c:  # fmt: skip
        c.start_coordinator()
        c.add_agent("node-a", "h200:2")
        c.wait_connected()
        yield c


def _json(cluster: LocalCluster, *args: str) -> Any:
    done = cluster.tp(*args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _script(mine: bytes, logdir: bytes) -> str:
    """The Job: its environment kept, two TensorBoard runs (real tensorboardX event files,
    unpacked once the member runs) in its own ``tb`` directory and under TENSORBOARD_LOGDIR,
    tuneplane.report lines in an ``eval`` directory, and a data file that is not metrics."""
    blob, other = base64.b64encode(mine).decode(), base64.b64encode(logdir).decode()
    return f"""set -e
env > "$TUNEPLANE_OUT_DIR/env.txt"
mkdir -p "$TUNEPLANE_OUT_DIR/tb" "$TENSORBOARD_LOGDIR/run1" "$TUNEPLANE_OUT_DIR/data"
echo '{blob}' | base64 -d > "$TUNEPLANE_OUT_DIR/tb/events.out.tfevents.1700000000.host"
echo '{other}' | base64 -d > "$TENSORBOARD_LOGDIR/run1/events.out.tfevents.1700000000.host"
echo '{{"step": 1, "loss": 9.0}}' > "$TUNEPLANE_OUT_DIR/data/train.jsonl"
python3 - <<'PY'
import os
from tuneplane.report import finish, init, log
init(dir=os.path.join(os.environ["TUNEPLANE_OUT_DIR"], "eval"))
for step in range({STEPS}):
    log({{"acc": step / {STEPS}}}, step=step)
finish()
PY
"""


def test_tensorboard_files_under_the_output_dir_reach_tp_metrics(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    written: dict[str, tuple[bytes, list[tuple[int, float]]]] = {}
    for tag, scale in (("tb/loss", 1.0), ("run1/loss", 2.0)):
        logdir = tmp_path / "written" / tag.split("/")[0]
        write_simple(logdir, {"loss": [(s, scale / (s + 1)) for s in range(STEPS)]})
        (event_file,) = logdir.iterdir()
        values = [(s, v) for s, _, v in tensorboard_scalars(logdir)["loss"]]
        written[tag] = (event_file.read_bytes(), values)
    project = tmp_path / "proj"
    project.mkdir()
    for args in (
        ("init", str(project), "--name", "tb"),
        ("new", "job", "--method", "custom/custom"),
    ):
        assert cluster.tp(*args, cwd=project).returncode == 0
    script = _script(written["tb/loss"][0], written["run1/loss"][0])
    (project / "experiments" / "job" / "train.sh").write_text(script)
    done = cluster.tp("submit", "job", "--profile", "h200:1", "--yes", "--json", cwd=project)
    assert done.returncode == 0, done.stderr
    run_id = json.loads(done.stdout.strip().splitlines()[-1])["run_id"]
    job = wait_until(
        "the Job to end",
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
    assert delivery["data_loss_warnings"] == 0
    tags = {t["tag"]: t["points"] for t in _json(cluster, "metrics", run_id)["tags"]}
    files = {tag: n for tag, n in tags.items() if not tag.startswith("system/")}
    # Each TensorBoard run under its own name; the researcher's data file is not metrics.
    assert files == {"tb/loss": STEPS, "run1/loss": STEPS, "eval/acc": STEPS}
    for tag in ("tb/loss", "run1/loss"):
        series = _json(cluster, "metrics", run_id, "--tag", tag, "--max-points", "1000")
        assert [(b["first_step"], b["last"]) for b in series["buckets"]] == written[tag][1]

    out_dir = Path(job["attempts"][0]["members"][0]["out_dir"])
    env = dict(
        line.split("=", 1) for line in (out_dir / "env.txt").read_text().splitlines() if "=" in line
    )
    tensorboard = str(out_dir / "tensorboard")
    assert env["TENSORBOARD_LOGDIR"] == tensorboard
    assert env["AIP_TENSORBOARD_LOG_DIR"] == tensorboard
    assert env["TUNEPLANE_TENSORBOARD_DIR"] == tensorboard
