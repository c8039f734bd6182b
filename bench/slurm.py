"""A Job on a Slurm Fleet against the same work submitted to Slurm directly, on one throwaway
cluster (tuneplane.coordinator.demo.slurm, with slurmrestd): submit -> running and submit -> exited.

Rules: runs alternate, ours then Slurm's, so a machine that slows down slows both alike. Ours is
Preview + Commit over the Api (one client, already connected), then GetJob polled every
:data:`POLL_S` until the Job is ``running`` and then ``succeeded``; the workload is ``sleep
1`` (a 1-member Job of 0 GPUs on a Slurm Fleet: one Slurm job whose srun step starts the Slurm
step, which starts the runner, which starts ``bash train.sh``). Slurm's is ``sbatch --wrap 'srun
sleep 1'``, with ``scontrol show job`` polled as often until RUNNING and then COMPLETED. Ratios
are ours / Slurm's over medians (lower is better). Needs root and Slurm with slurmrestd; says
what is missing otherwise and prints nothing else.
"""

from __future__ import annotations

import asyncio
import base64
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.coordinator.grpc_client import Api, api_client, jobspec
from tests.support.coordinator import start_coordinator
from tuneplane.coordinator.demo.slurm import SlurmCluster, SlurmUnavailable, slurm_cluster

RUNS = 5
POLL_S = 0.02
TIMEOUT_S = 120.0
PROFILES = '\n[profiles.hpc-cpu]\nseries = "cpu"\nfleet = "hpc"\n'
WORK = "sleep 1\n"


async def _ours_once(api: Api, spec: dict[str, Any], run: int) -> tuple[float, float]:
    started = time.monotonic()
    receipt = await api.submit(spec, f"bench-{run}-{time.time_ns()}")
    running = 0.0
    while True:
        job = await api.job(receipt.run_id)
        now = time.monotonic() - started
        if job.state == "running" and not running:
            running = now
        if job.state in ("succeeded", "failed", "cancelled", "aborted"):
            if job.state != "succeeded":
                raise RuntimeError(f"the bench Job ended {job.state}: {job.state_reason}")
            return running or now, now
        if now > TIMEOUT_S:
            raise RuntimeError(f"the bench Job did not end in {TIMEOUT_S:g} s")
        await asyncio.sleep(POLL_S)


def _alternate(
    cluster: SlurmCluster, address: str, ca: Path, token: str
) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """``RUNS`` runs of each side, ours then Slurm's, run by run."""
    spec = jobspec(gpus=0, profile="hpc-cpu")
    spec["source_files"] = {"train.sh": base64.b64encode(WORK.encode()).decode()}

    async def main() -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
        ours, theirs = [], []
        async with api_client(address, ca, token) as api:
            for run in range(RUNS):
                ours.append(await _ours_once(api, spec, run))
                theirs.append(await asyncio.to_thread(_slurm_once, cluster))
        return ours, theirs

    return asyncio.run(main())


def _slurm_once(cluster: SlurmCluster) -> tuple[float, float]:
    started = time.monotonic()
    out = cluster.client("sbatch", "--parsable", "-o", "/dev/null", "--wrap", "srun sleep 1")
    job_id = out.strip().split(";")[0]
    running = 0.0
    while True:
        state = subprocess.run(
            ["scontrol", "show", "job", job_id, "-o"], env=cluster.env, capture_output=True,
            text=True, timeout=30, check=False,
        ).stdout  # fmt: skip
        now = time.monotonic() - started
        if "JobState=RUNNING" in state and not running:
            running = now
        if "JobState=COMPLETED" in state:
            return running or now, now
        if "JobState=FAILED" in state or "JobState=CANCELLED" in state or now > TIMEOUT_S:
            raise RuntimeError(f"Slurm's bench job did not complete: {state.strip()}")
        time.sleep(POLL_S)


def _line(label: str, values: list[float]) -> str:
    median = statistics.median(values) * 1000
    return f"  {label:<44} median {median:7.0f} ms   max {max(values) * 1000:7.0f} ms"


def main() -> int:
    try:
        cluster_cm = slurm_cluster()
        cluster = cluster_cm.__enter__()
    except SlurmUnavailable as skipped:
        print(f"  Slurm bench not run: {skipped}")
        return 0
    try:
        with tempfile.TemporaryDirectory(prefix="tp-bench-slurm-") as folder:
            root = Path(folder)
            (root / "shared").mkdir()
            token = root / "slurm.token"
            token.write_text(cluster.token() + "\n")
            with start_coordinator(root, config=PROFILES) as coord:
                made = coord.admin(
                    "fleet", "create", "hpc", "--kind", "slurm", "--slurmrestd",
                    cluster.rest_url, "--token-file", str(token), "--partition",
                    cluster.partition, "--shared-dir", str(root / "shared"), "--python",
                    sys.executable, "--spool-dir", str(root / "spool"),
                )  # fmt: skip
                if made.returncode != 0:
                    print(f"  Slurm bench not run: {made.stderr.strip()}")
                    return 1
                ours, slurm = _alternate(cluster, coord.api, coord.ca_path, coord.admin_token)
    finally:
        cluster_cm.__exit__(None, None, None)
    print(f"a 1-member Job on a Slurm Fleet vs sbatch + srun, `{WORK.strip()}`, {RUNS} runs each:")
    for index, what in ((0, "submit -> running"), (1, "submit -> exited")):
        mine, theirs = [o[index] for o in ours], [s[index] for s in slurm]
        print(_line(f"TunePlane on Slurm: {what}", mine))
        print(_line(f"Slurm (sbatch --wrap 'srun sleep 1'): {what}", theirs))
        ratio = statistics.median(mine) / statistics.median(theirs)
        print(f"  ratio ours / Slurm ({what}, medians) {ratio:.2f}")
    return 0
