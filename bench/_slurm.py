"""A throwaway single-node Slurm cluster on this machine: the baseline some bench figures are held
against (issue 13). It is the one cluster the demo and the tests start
(:mod:`tuneplane.coordinator.demo.slurm`), without slurmrestd; this module adds the measurements
the bench takes on it.

Rules: the bench installs nothing. When this machine can run the cluster (Slurm's daemons and
clients on PATH, as root), :func:`slurm_cluster` starts it with ended jobs purged after
:data:`MIN_JOB_AGE_S` (one measurement's jobs do not weigh on the next) and room for
:data:`MAX_JOB_COUNT` jobs (the admissions bench queues more than Slurm's default 10,000), then
checks that it launches (``srun -n1 true``). Otherwise it prints one sentence naming what is
missing and how to install it, and yields None: the caller prints its own figures alone. A
cluster that does not start gets its daemons' logs printed and the same None. The demo module
stops every daemon by PID and removes the folder on exit. Clients get the cluster's
``SLURM_CONF`` and none of the caller's ``SLURM_*`` variables, so a bench run inside a Slurm job
never talks to that job's cluster.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

from tuneplane.coordinator.demo import slurm as demo

MIN_JOB_AGE_S = 2
MAX_JOB_COUNT = 50000
# Job ids per scancel call: far below any argv limit.
CANCEL_BATCH = 500


class SlurmCluster:
    """The running cluster and the measurements the bench takes on it."""

    def __init__(self, cluster: demo.SlurmCluster) -> None:
        self._cluster = cluster
        self.root: Path = cluster.root
        self.host = cluster.host
        self.env = cluster.env
        self.held: list[str] = []

    def slurmd_pid(self) -> int:
        """The (only) node's slurmd: the daemon the cluster started in the foreground."""
        return self._cluster.daemon("slurmd").proc.pid

    def client(self, *args: str) -> str:
        """Run a Slurm client command against this cluster; its stdout (RuntimeError, with
        its words, when it fails)."""
        try:
            return self._cluster.client(*args)
        except AssertionError as error:
            raise RuntimeError(str(error)) from None

    def srun(self, processes: int) -> float:
        """Seconds of ``srun -n<processes> [--overcommit] true``, from start to exit."""
        over = ["--overcommit"] if processes > 1 else []
        started = time.perf_counter()
        self.client("srun", f"-n{processes}", *over, "true")
        return time.perf_counter() - started

    def _sbatch(self) -> str:
        out = self.client("sbatch", "--parsable", "--hold", "-o", "/dev/null", "--wrap", "true")
        return out.strip().split(";")[0]

    def sbatch_rate(self, jobs: int, parallel: int) -> float:
        """Jobs accepted per second by ``sbatch --hold --wrap true``: ``parallel`` submitters
        (1: a loop), ``jobs`` in all, after one unmeasured sbatch. Held, so they stay queued as
        the bench's admitted TunePlane Jobs do and none runs on this machine's CPUs meanwhile;
        every one (the unmeasured one too) stays until :meth:`cancel_held`."""
        self.held.append(self._sbatch())
        started = time.perf_counter()
        self.queue_held(jobs, parallel)
        return jobs / (time.perf_counter() - started)

    def queue_held(self, jobs: int, parallel: int = 8) -> None:
        """Submit ``jobs`` held jobs, ``parallel`` at a time, left queued until
        :meth:`cancel_held`."""
        if parallel <= 1:
            self.held.extend(self._sbatch() for _ in range(jobs))
        else:
            with ThreadPoolExecutor(parallel) as pool:
                self.held.extend(pool.map(lambda _: self._sbatch(), range(jobs)))

    def cancel_held(self) -> None:
        """Cancel every job :meth:`sbatch_rate` and :meth:`queue_held` left queued."""
        for i in range(0, len(self.held), CANCEL_BATCH):
            self.client("scancel", *self.held[i : i + CANCEL_BATCH])
        self.held.clear()

    def pending(self) -> int:
        """Jobs pending now (squeue)."""
        return len(self.client("squeue", "-h", "-t", "PD", "-o", "%i").split())

    def node_state(self) -> str:
        return self.client("sinfo", "-h", "-n", self.host, "-o", "%T").strip()


@contextmanager
def slurm_cluster() -> Iterator[SlurmCluster | None]:
    """The throwaway cluster, or None (with the reason printed) when this machine cannot run
    one; stopped and removed on exit."""
    lacking = demo.missing(rest=False)
    if lacking is not None:
        print(
            f"Slurm baseline skipped: comparing against real Slurm needs {lacking} (Debian, "
            "Ubuntu), and the bench run as root."
        )
        yield None
        return
    with ExitStack() as stack:
        try:
            started = stack.enter_context(demo.slurm_cluster(
                rest=False, min_job_age_s=MIN_JOB_AGE_S, max_job_count=MAX_JOB_COUNT,
            ))  # fmt: skip
        except (AssertionError, demo.SlurmUnavailable) as error:
            print(f"Slurm baseline skipped: the throwaway cluster did not start: {error}")
            yield None
            return
        cluster = SlurmCluster(started)
        try:  # an idle node that cannot launch (credentials, slurmstepd) fails here, not mid-bench
            cluster.srun(1)
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            print(f"Slurm baseline skipped: srun -n1 true failed on the throwaway cluster: {error}")
            print(started.logs())
            yield None
            return
        sys.stdout.flush()
        yield cluster
