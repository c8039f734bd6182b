"""Jobs on a Fleet of kind slurm, end to end: a real coordinator, the real `tp`, a real throwaway
Slurm (tests/support/slurm.py) and the real Slurm step on its node.

- A 1-member Job succeeds: one Slurm job named by the attempt, its id in the decision log, the
  member's output in its log file on the Fleet's shared folder and in `tp logs`, its JSONL
  points in `tp metrics` (shipped by its collector on the Slurm node).
- A failing member fails the Job with its exit code (and the runner's exit record says it); a
  retry is a new attempt, submitted as a new Slurm job under the new attempt's name.
- A cancelled running Job ends ``cancelled`` and its workload process is gone.
- A process-group Job on this one-node cluster: 1 member x 2 GPUs, two ranks with RANK,
  LOCAL_RANK and WORLD_SIZE as on a Node (several nodes, each a host of its own:
  tests/integration/test_slurm_nodes.py).
- The coordinator killed after submitting and before recording the job id finds its job by name
  when started again: one Slurm job, not two.
- slurmrestd killed (SIGKILL) mid-Job makes the Job ``unknown``; started again, the real state
  returns.
- A Job Slurm requeues after it ran (``scontrol requeue``) goes back to ``reserved`` saying so,
  runs again in its own member folder (``restart-1/member-0/``) and succeeds: `tp logs` shows
  both runs' lines in order (also across a coordinator restart), `tp metrics` holds both runs'
  points, and it stays one Slurm job.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.agent.jobs import tp
from tests.faults.jobs import project, submit
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.processes import wait_until
from tests.support.slurm import SlurmCluster, slurm_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PROFILES = (
    '\n[profiles.hpc]\nseries = "h200"\nfleet = "hpc"\n'
    '\n[profiles.hpc-cpu]\nseries = "cpu"\nfleet = "hpc"\n'
)
JOB_TIMEOUT_S = 90.0
ENDED = frozenset({"succeeded", "failed", "cancelled", "aborted"})


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    with slurm_cluster() as running:
        yield running


@contextmanager
def slurm_coordinator(
    cluster: SlurmCluster, tmp_path: Path, env: dict[str, str] | None = None
) -> Iterator[tuple[CoordinatorProcess, Path]]:
    """A coordinator with the Fleet ``hpc`` on the cluster; yields it and the shared folder."""
    shared = tmp_path / "shared"
    shared.mkdir()
    token = tmp_path / "slurm.token"
    token.write_text(f"SLURM_JWT={cluster.token()}\n")
    with start_coordinator(tmp_path, config=PROFILES, env=env) as coord:
        made = coord.admin("fleet", "create", "hpc", "--kind", "slurm", "--slurmrestd",
                           cluster.rest_url, "--token-file", str(token), "--partition",
                           cluster.partition, "--shared-dir", str(shared), "--python",
                           sys.executable, "--spool-dir", str(tmp_path / "spool"))  # fmt: skip
        assert made.returncode == 0, made.stderr
        yield coord, shared


def job(coord: CoordinatorProcess, run_id: str) -> dict[str, Any]:
    shown: dict[str, Any] = json.loads(tp(coord, "job", "show", run_id, "--json"))
    return shown


def wait_state(coord: CoordinatorProcess, run_id: str, state: str) -> dict[str, Any]:
    """Poll `tp job show` until the Job is in ``state``; fail at once when it ended otherwise,
    and with the last Job seen and the coordinator's log on timeout."""
    seen: dict[str, Any] = {}

    def reached() -> bool:
        seen.update(job(coord, run_id))
        if seen["state"] != state and seen["state"] in ENDED:
            raise AssertionError(f"job {run_id} ended {seen['state']}, not {state}: {seen}")
        return bool(seen["state"] == state)

    try:
        wait_until(f"job {run_id} to be {state}", reached, JOB_TIMEOUT_S)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nlast seen: {seen}\n{coord.read_log()[-3000:]}") from None
    return seen


def member(shared: Path, run_id: str, index: int = 0, attempt: int = 1) -> Path:
    return shared / run_id / f"attempt-{attempt}" / f"member-{index}"


def slurm_jobs_named(cluster: SlurmCluster, name: str) -> list[str]:
    out = cluster.client("squeue", "-h", "-t", "all", "-n", name, "-o", "%i")
    return out.split()


def submitted(coord: CoordinatorProcess, run_id: str) -> list[dict[str, Any]]:
    return [d for d in coord.decisions("slurm submitted") if d["run_id"] == run_id]


def test_a_one_member_job_runs_as_one_slurm_job_and_succeeds(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    with slurm_coordinator(cluster, tmp_path) as (coord, shared):
        root = project(coord, tmp_path / "proj", "custom/custom", {
            "train.sh": 'echo "hello from member $TUNEPLANE_MEMBER_INDEX of '
                        '$TUNEPLANE_MEMBER_COUNT on $NNODES node(s), GPUs $CUDA_VISIBLE_DEVICES"\n'
                        'echo \'{"step": 1, "loss": 0.5}\' > "$TUNEPLANE_TELEMETRY_DIR/m.jsonl"\n'
                        'echo \'{"step": 2, "loss": 0.25}\' >> "$TUNEPLANE_TELEMETRY_DIR/m.jsonl"\n'
        })  # fmt: skip
        run_id = submit(coord, root, "hpc:1")
        done = wait_state(coord, run_id, "succeeded")
        assert "completed" in done["state_reason"], done
        [decision] = submitted(coord, run_id)
        job_id = decision["detail"]["slurm_job_id"]
        assert decision["detail"]["found_by_name"] is False
        assert slurm_jobs_named(cluster, f"tp-{run_id}-a1") == [str(job_id)]
        out = (member(shared, run_id) / "stdout.log").read_text()
        assert out == "hello from member 0 of 1 on 1 node(s), GPUs 0\n"
        assert tp(coord, "logs", run_id) == out  # the coordinator shipped it for `tp logs`
        # The member's collector shipped its points with its own credential, as on a Node.
        tags = {
            t["tag"]: t["points"]
            for t in json.loads(tp(coord, "metrics", run_id, "--json"))["tags"]
        }
        assert tags.get("loss") == 2, tags
        assert list(member(shared, run_id).glob("collector.credential"))
        exit_record = json.loads((member(shared, run_id) / "exit.json").read_text())
        assert exit_record["exit_code"] == 0


def test_a_failing_member_fails_the_job_with_its_exit_code(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    with slurm_coordinator(cluster, tmp_path) as (coord, shared):
        root = project(
            coord, tmp_path / "proj", "custom/custom", {"train.sh": "echo boom >&2\nexit 3\n"}
        )
        run_id = submit(coord, root, "hpc-cpu:0")
        done = wait_state(coord, run_id, "failed")
        assert (
            "ended FAILED (member 0 failed first; it exited with code 3)" in done["state_reason"]
        ), done
        exit_record = json.loads((member(shared, run_id) / "exit.json").read_text())
        assert exit_record["exit_code"] == 3
        assert tp(coord, "logs", run_id, "--stderr") == "boom\n"
        # A retry is a new attempt, so a new Slurm job under a new name.
        tp(coord, "job", "retry", run_id)
        again = wait_state(coord, run_id, "failed")
        assert [a["number"] for a in again["attempts"]] == [1, 2]
        [first, second] = sorted(submitted(coord, run_id), key=lambda d: d["id"])
        assert first["detail"]["slurm_job_id"] != second["detail"]["slurm_job_id"]
        assert len(slurm_jobs_named(cluster, f"tp-{run_id}-a2")) == 1
        assert (
            json.loads((member(shared, run_id, attempt=2) / "exit.json").read_text())["exit_code"]
            == 3
        )


def test_a_cancelled_running_job_ends_cancelled_and_its_processes_are_gone(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    with slurm_coordinator(cluster, tmp_path) as (coord, shared):
        script = 'echo $$ > "$TUNEPLANE_OUT_DIR/pid"\nexec sleep 300\n'
        root = project(coord, tmp_path / "proj", "custom/custom", {"train.sh": script})
        run_id = submit(coord, root, "hpc-cpu:0")
        pid_file = member(shared, run_id) / "out" / "pid"
        wait_until("the workload to start", pid_file.exists, JOB_TIMEOUT_S)
        wait_state(coord, run_id, "running")
        pid = int(wait_until("its pid", lambda: pid_file.read_text().strip(), 10))
        tp(coord, "job", "cancel", run_id)
        done = wait_state(coord, run_id, "cancelled")
        assert done["state_reason"].startswith("cancelled by"), done
        wait_until("the workload process to be gone", lambda: not _alive(pid), 30)
        kinds = [d["kind"] for d in coord.decisions("slurm signal") if d["run_id"] == run_id]
        assert kinds == ["slurm signal"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie not yet reaped is gone for every purpose here.
    try:
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False


RANKS_PY = r"""
import json, os
from pathlib import Path
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "NNODES", "MASTER_ADDR", "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES")
seen = {k: os.environ.get(k) for k in keys}
(Path(os.environ["TUNEPLANE_OUT_DIR"]) / f"rank-{seen['RANK']}.json").write_text(json.dumps(seen))
"""


def test_a_process_group_job_gets_the_rank_environment_of_a_node(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    with slurm_coordinator(cluster, tmp_path) as (coord, shared):
        root = project(coord, tmp_path / "proj", "pytorch/process-group", {"train.py": RANKS_PY})
        run_id = submit(coord, root, "hpc:2")
        wait_state(coord, run_id, "succeeded")
        out = member(shared, run_id) / "out"
        ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)]
        for rank, seen in enumerate(ranks):
            assert seen["RANK"] == seen["LOCAL_RANK"] == str(rank)
            assert (seen["WORLD_SIZE"], seen["NNODES"], seen["NODE_RANK"]) == ("2", "1", "0")
            assert seen["MASTER_ADDR"] == cluster.host
            assert seen["CUDA_VISIBLE_DEVICES"] == str(rank)
        assert ranks[0]["MASTER_PORT"] == ranks[1]["MASTER_PORT"]


def test_a_coordinator_killed_between_submit_and_record_finds_its_job_by_name(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    crash = {"TUNEPLANE_CRASHPOINT": "after-slurm-submit"}
    with slurm_coordinator(cluster, tmp_path, env=crash) as (coord, shared):
        root = project(coord, tmp_path / "proj", "custom/custom", {"train.sh": "echo once\n"})
        run_id = submit(coord, root, "hpc-cpu:0")
        assert coord.wait_exit() == 137
        # Submitted, and the job id never recorded: only the name connects them.
        assert len(slurm_jobs_named(cluster, f"tp-{run_id}-a1")) == 1
        coord.restart()
        wait_state(coord, run_id, "succeeded")
        [decision] = submitted(coord, run_id)
        assert decision["detail"]["found_by_name"] is True
        assert slurm_jobs_named(cluster, f"tp-{run_id}-a1") == [
            str(decision["detail"]["slurm_job_id"])
        ]
        assert (member(shared, run_id) / "stdout.log").read_text() == "once\n"


def test_slurmrestd_killed_mid_job_makes_it_unknown_until_it_answers_again(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    with slurm_coordinator(cluster, tmp_path) as (coord, shared):
        script = 'while [ ! -e "$TUNEPLANE_OUT_DIR/go" ]; do sleep 0.2; done\n'
        root = project(coord, tmp_path / "proj", "custom/custom", {"train.sh": script})
        run_id = submit(coord, root, "hpc-cpu:0")
        wait_state(coord, run_id, "running")
        cluster.stop_rest(signal.SIGKILL)  # a crash: no goodbye to its clients
        try:
            lost = wait_state(coord, run_id, "unknown")
            assert "slurmrestd does not answer" in lost["state_reason"], lost
        finally:
            cluster.start_rest()
        wait_state(coord, run_id, "running")
        (member(shared, run_id) / "out" / "go").touch()
        wait_state(coord, run_id, "succeeded")


FAIL_RANK_PY = r"""
import os, sys, time
if os.environ["RANK"] == "1":
    sys.exit(5)
time.sleep(30)  # rank 0 would run on: the runner stops it when rank 1 fails
"""


def test_each_members_exit_is_recorded_and_shown_when_one_rank_fails(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    with slurm_coordinator(cluster, tmp_path) as (coord, shared):
        root = project(coord, tmp_path / "proj", "pytorch/process-group",
                       {"train.py": FAIL_RANK_PY})  # fmt: skip
        run_id = submit(coord, root, "hpc:2")
        done = wait_state(coord, run_id, "failed")
        [attempt] = done["attempts"]
        [only] = attempt["members"]  # one node: one member, two ranks
        assert (only["index"], only["state"], only["has_exit"]) == (0, "exited", True), only
        assert (only["exit_code"], only["signal"]) == (5, 0), only
        exit_record = json.loads((member(shared, run_id) / "exit.json").read_text())
        assert exit_record["exit_code"] == 5
        [decision] = [d for d in coord.decisions("slurm member exits") if d["run_id"] == run_id]
        assert decision["detail"]["exits"] == [[0, 5, 0]]
        shown = tp(coord, "job", "show", run_id)
        assert "MEMBER (RANK)" in shown and " exited " in shown and " 5 " in shown, shown


# Each run: one line to stdout and one JSONL point (step = the run's number, counted in a file
# outside the job's folders), then wait for that run's gate file.
REQUEUED_SH = """
n=$(( $(cat {gate}/runs 2>/dev/null || echo 0) + 1 ))
echo $n > {gate}/runs
echo "run $n says hello"
echo '{{"step": '$n', "loss": 0.'$n'}}' > "$TUNEPLANE_TELEMETRY_DIR/m.jsonl"
while [ ! -e {gate}/go-$n ]; do sleep 0.1; done
"""


def loss_points(coord: CoordinatorProcess, run_id: str) -> dict[str, int]:
    """Points of the tag ``loss`` by source id (`tp metrics --raw --json`)."""
    tags = json.loads(tp(coord, "metrics", run_id, "--raw", "--json"))["tags"]
    return {t["source"]: t["points"] for t in tags if t["tag"] == "loss"}


def submit_gated(coord: CoordinatorProcess, tmp_path: Path, profile: str) -> tuple[str, Path]:
    """A Job of REQUEUED_SH (run n waits for ``go-<n>`` in its gate folder) on ``profile``,
    once running: its run id and gate folder."""
    gate = tmp_path / "gate"
    gate.mkdir()
    script = REQUEUED_SH.format(gate=gate)
    root = project(coord, tmp_path / "proj", "custom/custom", {"train.sh": script})
    run_id = submit(coord, root, profile)
    wait_state(coord, run_id, "running")
    return run_id, gate


def slurm_job_id(coord: CoordinatorProcess, run_id: str) -> str:
    """The one Slurm job the coordinator submitted for ``run_id``."""
    [decision] = submitted(coord, run_id)
    return str(decision["detail"]["slurm_job_id"])


def start_requeued_now(cluster: SlurmCluster, job_id: str, second: Path) -> None:
    """Start a requeued job now, and wait for its second run's line in ``second``: Slurm holds
    a requeued job until its BeginTime (minutes away); once it is pending (the first run's
    processes gone), it may start at once. The BeginTime is set again whenever Slurm still
    gives it as the reason the job waits (its requeue may still be settling), and a timeout
    says what Slurm shows of the job, its node and its daemons."""
    wait_until(
        f"Slurm job {job_id} to be pending",
        lambda: cluster.client("squeue", "-h", "-j", job_id, "-o", "%T").strip() == "PENDING",
        JOB_TIMEOUT_S,
    )
    log = second / "stdout.log"

    def started() -> bool:
        if log.exists() and log.read_text() == "run 2 says hello\n":
            return True
        if cluster.client("squeue", "-h", "-j", job_id, "-o", "%T %r").split() == [
            "PENDING",
            "BeginTime",
        ]:
            cluster.client("scontrol", "update", f"JobId={job_id}", "StartTime=now")
        return False

    try:
        wait_until("the second run's line", started, JOB_TIMEOUT_S)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{slurm_view(cluster, job_id, second)}") from None


def slurm_view(cluster: SlurmCluster, job_id: str, member_dir: Path) -> str:
    """What Slurm shows of ``job_id`` and its node, its daemons' logs, and the files of the
    Job's member folders (``member_dir``'s Job folder): what a stuck Slurm test reports."""

    def shown(*args: str) -> str:
        try:
            return cluster.client(*args)
        except AssertionError as exc:  # a daemon that stopped says so in its log, below
            return str(exc)

    job_folder = member_dir.parent.parent
    files = sorted(str(p.relative_to(job_folder)) for p in job_folder.rglob("*"))
    return "\n".join(
        [
            shown("scontrol", "show", "job", job_id),
            shown("sinfo", "-N", "-o", "%N %T %E"),
            f"files under {job_folder}: {files}",
            cluster.logs(),
        ]
    )


def test_a_job_slurm_requeues_after_it_ran_goes_back_to_reserved_and_runs_again(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    with slurm_coordinator(cluster, tmp_path) as (coord, shared):
        run_id, gate = submit_gated(coord, tmp_path, "hpc-cpu:0")
        first = member(shared, run_id)
        second = first.parent / "restart-1" / "member-0"
        wait_until("the first run's point", lambda: loss_points(coord, run_id), JOB_TIMEOUT_S)
        job_id = slurm_job_id(coord, run_id)
        cluster.client("scontrol", "requeue", job_id)
        again = wait_state(coord, run_id, "reserved")
        assert f"Slurm job {job_id} was requeued by Slurm (1 time)" in again["state_reason"], again
        history = [s["state"] for s in again["history"]]
        assert history[-2:] == ["running", "reserved"], history
        start_requeued_now(cluster, job_id, second)
        wait_state(coord, run_id, "running")
        wait_until("the second run's point", lambda: len(loss_points(coord, run_id)) == 2,
                   JOB_TIMEOUT_S)  # fmt: skip
        both = "run 1 says hello\nrun 2 says hello\n"
        wait_until("both runs' lines in `tp logs`", lambda: tp(coord, "logs", run_id) == both,
                   JOB_TIMEOUT_S)  # fmt: skip
        # A coordinator restarted mid-run reads every run's logs from byte 0 again: nothing
        # is stored twice.
        coord.restart()
        (gate / "go-2").touch()
        done = wait_state(coord, run_id, "succeeded")
        assert f"Slurm job {job_id} completed" in done["state_reason"], done
        # The first run's folder is as the requeue left it; the second has its own exit.
        assert (first / "stdout.log").read_text() == "run 1 says hello\n"
        assert json.loads((second / "exit.json").read_text())["exit_code"] == 0
        [attempt] = done["attempts"]
        [only] = attempt["members"]
        assert (only["state"], only["has_exit"], only["exit_code"], only["signal"]) == (
            "exited", True, 0, 0), only  # fmt: skip
        assert tp(coord, "logs", run_id) == both
        # Both runs' points are stored, the second's under its restart's source id.
        assert loss_points(coord, run_id) == {
            "telemetry/m.jsonl": 1, "restart-1/telemetry/m.jsonl": 1}  # fmt: skip
        [loss] = [t for t in json.loads(tp(coord, "metrics", run_id, "--json"))["tags"]
                  if t["tag"] == "loss"]  # fmt: skip
        assert (loss["points"], loss["last_step"], loss["last_value"]) == (2, 2, 0.2), loss
        assert slurm_jobs_named(cluster, f"tp-{run_id}-a1") == [job_id]
