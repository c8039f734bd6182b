"""A TunePlane Job preempted by a higher-priority Slurm job: Slurm requeues it, TunePlane says so
and never calls it failed, and once the urgent job is gone the Job runs again and succeeds.
(Slurm 22.05 shows the preempted job RUNNING, then COMPLETING with its restart count up, then
PENDING: never PREEMPTED, which is PreemptMode=CANCEL's word.)

The throwaway cluster (coordinator/demo/slurm_conf.py) has an urgent partition on the same
node whose jobs preempt the default partition's (``PreemptType=preempt/partition_prio``,
``PreemptMode=REQUEUE``), as a site's high-priority queue does. A plain ``sbatch --exclusive``
there takes the whole node from the running Job.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent.jobs import tp
from tests.integration.test_slurm_jobs import (
    JOB_TIMEOUT_S,
    job,
    member,
    slurm_coordinator,
    slurm_job_id,
    start_requeued_now,
    submit_gated,
    submitted,
    wait_state,
)
from tests.support.processes import wait_until
from tests.support.slurm import SlurmCluster, slurm_cluster
from tuneplane.coordinator.demo.slurm import URGENT_PARTITION

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    with slurm_cluster() as running:
        yield running


def slurm_state(cluster: SlurmCluster, job_id: str) -> str:
    return cluster.client("squeue", "-h", "-j", job_id, "-o", "%T").strip()


def test_a_job_preempted_by_an_urgent_slurm_job_is_requeued_never_failed_and_runs_again(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    with slurm_coordinator(cluster, tmp_path) as (coord, shared):
        run_id, gate = submit_gated(coord, tmp_path, "hpc:1")
        job_id = slurm_job_id(coord, run_id)
        first = member(shared, run_id)
        wait_until("the first run's line", lambda: (first / "stdout.log").exists(), JOB_TIMEOUT_S)
        # The site's urgent queue wants the whole node.
        urgent = cluster.client(
            "sbatch", "--parsable", "-p", URGENT_PARTITION, "--exclusive", "-J", "urgent",
            "-o", "/dev/null", "--wrap", "sleep 300",
        ).strip()  # fmt: skip
        try:
            again = wait_state(coord, run_id, "reserved")
            assert f"Slurm job {job_id} was requeued by Slurm (1 time)" in again["state_reason"]
            wait_until(
                "the urgent job to run",
                lambda: slurm_state(cluster, urgent) == "RUNNING",
                JOB_TIMEOUT_S,
            )
            # Ours waits while the urgent job holds the node: reserved, saying why.
            held = job(coord, run_id)
            assert held["state"] == "reserved", held
        finally:
            cluster.client("scancel", urgent)
        second = first.parent / "restart-1" / "member-0"
        start_requeued_now(cluster, job_id, second)
        (gate / "go-2").touch()
        done = wait_state(coord, run_id, "succeeded")
        # Never failed on the way: preempted, requeued, pending, running, done.
        history = [s["state"] for s in done["history"]]
        assert "failed" not in history and "unknown" not in history, history
        assert history[-4:] == ["running", "reserved", "running", "succeeded"], history
        assert json.loads((second / "exit.json").read_text())["exit_code"] == 0
        [attempt] = done["attempts"]
        [only] = attempt["members"]  # the last run's exit, not the preempted one's
        assert (only["has_exit"], only["exit_code"], only["signal"]) == (True, 0, 0), only
        wait_until(
            "both runs' lines in `tp logs`",
            lambda: tp(coord, "logs", run_id) == "run 1 says hello\nrun 2 says hello\n",
            JOB_TIMEOUT_S,
        )
        # One Slurm job throughout: requeued, not submitted again.
        assert len(submitted(coord, run_id)) == 1
