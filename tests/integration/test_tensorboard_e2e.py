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


PHASES = 3

# Three phases, each with new run directories (a tensorboardX event file unpacked, and a
# tuneplane.report file), the later ones waiting for the test's go-ahead so the agent can be
# killed between them.
PHASED = """set -e
python3 - <<'PY'
import base64, os, sys, time
from tuneplane.report import finish, init, log
out = os.environ["TUNEPLANE_OUT_DIR"]
blobs = {blobs!r}
for phase, blob in enumerate(blobs):
    if phase:
        while not os.path.exists(f"{{out}}/go{{phase}}"):
            time.sleep(0.05)
    os.makedirs(f"{{out}}/tb/run{{phase}}")
    with open(f"{{out}}/tb/run{{phase}}/events.out.tfevents.1700000000.host", "wb") as f:
        f.write(base64.b64decode(blob))
    init(dir=f"{{out}}/eval/run{{phase}}")
    for step in range({steps}):
        log({{"acc": phase + step / {steps}}}, step=step)
    finish()
    open(f"{{out}}/phase{{phase}}-done", "w").close()
PY
"""


def _restart_agent(cluster: LocalCluster) -> None:
    agent = cluster.agents[0]
    agent.process.popen.kill()
    agent.process.popen.wait()
    argv = [str(a) for a in agent.process.popen.args]  # type: ignore[union-attr]
    agent.process = cluster._spawn(agent.name, argv)
    cluster.wait_connected()


def test_new_runs_arrive_once_through_an_agent_kill_9(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    blobs, expected = [], {}
    for phase in range(PHASES):
        logdir = tmp_path / "written" / f"run{phase}"
        write_simple(logdir, {"loss": [(s, (phase + 1.0) / (s + 1)) for s in range(STEPS)]})
        (event_file,) = logdir.iterdir()
        blobs.append(base64.b64encode(event_file.read_bytes()).decode())
        expected[f"tb/run{phase}/loss"] = [
            (s, v) for s, _, v in tensorboard_scalars(logdir)["loss"]
        ]
        expected[f"eval/run{phase}/acc"] = [(s, phase + s / STEPS) for s in range(STEPS)]
    project = tmp_path / "proj"
    project.mkdir()
    for args in (
        ("init", str(project), "--name", "tbkill"),
        ("new", "job", "--method", "custom/custom"),
    ):
        assert cluster.tp(*args, cwd=project).returncode == 0
    script = PHASED.format(blobs=blobs, steps=STEPS)
    (project / "experiments" / "job" / "train.sh").write_text(script)
    done = cluster.tp("submit", "job", "--profile", "h200:1", "--yes", "--json", cwd=project)
    assert done.returncode == 0, done.stderr
    run_id = json.loads(done.stdout.strip().splitlines()[-1])["run_id"]

    def out_dir() -> Path | None:
        job = _json(cluster, "job", "show", run_id)
        members = job["attempts"][0]["members"] if job["attempts"] else []
        return Path(members[0]["out_dir"]) if members and members[0]["out_dir"] else None

    out = wait_until("the member's output directory", out_dir, timeout=60)

    def stored() -> int:
        members = _json(cluster, "metrics", run_id, "--delivery")["members"]
        return int(members[0]["points_stored"]) if members else 0

    # Phase 0 delivered in part or whole, then the agent dies; phase 1 is written while no agent
    # runs (its collector stopped with it), and phase 2 after the new agent took over.
    wait_until("phase 0's first points stored", lambda: stored() > 0, timeout=60)
    cluster.agents[0].process.popen.kill()
    cluster.agents[0].process.popen.wait()
    (out / "go1").touch()
    wait_until("phase 1 written", lambda: (out / "phase1-done").exists(), timeout=60)
    _restart_agent(cluster)
    (out / "go2").touch()
    job = wait_until(
        "the Job to end",
        lambda: (
            (j := _json(cluster, "job", "show", run_id))["state"] in ("succeeded", "failed") and j
        ),
        timeout=90,
    )
    assert job["state"] == "succeeded", job

    def drained() -> Any:
        members = _json(cluster, "metrics", run_id, "--delivery")["members"]
        return members if members and all(m["drained"] for m in members) else None

    (delivery,) = wait_until("the collector to deliver everything", drained, timeout=90)
    assert delivery["data_loss_warnings"] == 0
    tags = {t["tag"]: t["points"] for t in _json(cluster, "metrics", run_id)["tags"]}
    files = {tag: n for tag, n in tags.items() if not tag.startswith("system/")}
    # Nothing lost, nothing twice: every run's series has exactly its points.
    assert files == {tag: STEPS for tag in expected}
    for tag, values in expected.items():
        series = _json(cluster, "metrics", run_id, "--tag", tag, "--max-points", "1000")
        assert [(b["first_step"], b["last"]) for b in series["buckets"]] == values, tag
