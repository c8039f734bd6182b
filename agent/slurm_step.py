"""``python -m tuneplane.agent.slurm_step <attempt folder>``: one member of an attempt that runs
as a Slurm job, started by ``srun`` (one task per node) on every node of the allocation.

Rules:
- The member is the node's rank in the allocation (``SLURM_NODEID`` of ``SLURM_NNODES``); the
  rendezvous is the allocation's first host (``SLURM_JOB_NODELIST``, expanded by ``scontrol show
  hostnames``) and a port derived from ``SLURM_JOB_ID`` (:func:`master_port`), so every node
  computes the same one without talking to another.
- What a Node does at Prepare and launch is done here with the same code: the experiment files
  and the capsule are written by :func:`~tuneplane.agent.prepare.materialise`, the processes and
  their rank environment planned by :func:`~tuneplane.agent.launch_plan.plan_processes`, and the
  runner (:func:`tuneplane.runner.main.run_in_foreground`) starts, supervises and records them.
- The GPUs are the ones Slurm gave the step (:func:`visible_gpus`).
- The exit status is the member's (its first failure's code, 128 + a signal, or 0), so Slurm's
  job state and exit code carry it; a member that cannot be set up exits 1 with a sentence.
- Each run of the Slurm job has its own member folder: Slurm starts a job it requeued again with
  ``SLURM_RESTART_COUNT`` r (absent: 0), and the member is prepared and run in
  ``member_dir(folder, index, r)`` (the contract's layout), so a requeued run claims a launch of
  its own and the first run's folder stays as it ended.
- The member's collector runs beside it, as on a Node, with the member-scoped credential the
  coordinator wrote into the first run's member folder (read there by every run; never copied);
  a requeued run's collector prefixes its source ids with ``restart-<r>/``, so its points are
  stored beside the first run's. Its spool is a private folder on this node, removed once it
  delivered everything.
- No Node journal or account pool: the workload runs as the Slurm job's user, which Slurm
  chose. A host runtime runs with no sandbox; an image runtime runs in its image under
  bubblewrap, the image made ready in the Fleet's image root (agent/slurm_image.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from tuneplane.proto.contract import jobspec
from tuneplane.proto.contract.slurm_attempt import (
    CREDENTIAL_FILE,
    AttemptFile,
    AttemptFileError,
    member_dir,
    read_attempt_file,
    source_prefix,
)
from tuneplane.runner.main import run_in_foreground

from . import runner_pyz
from .collectors import DRAINED_MARKER, EXITED_MARKER, telemetry_dir, tensorboard_dir
from .launch_plan import LaunchPlanError, member_env, plan_processes, workload_env
from .prepare import CAPSULE_DIR, PrepareRefused, materialise, read_capsule
from .slurm_image import SlurmImageError, image_of, plan_image
from .supervision import MemberLaunch, write_launch

EXIT_SETUP_FAILED = 1
EXIT_USAGE = 64
#: Rendezvous ports: MASTER_PORT is PORT_BASE + SLURM_JOB_ID % PORT_SPAN.
PORT_BASE = 20000
PORT_SPAN = 20000
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
#: How long the collector may take, after the member ended, to deliver what it holds.
DRAIN_TIMEOUT_S = 60.0


class StepError(RuntimeError):
    """The member cannot be set up on this node; the message says why and what to fix."""


def master_port(job_id: int) -> int:
    return PORT_BASE + job_id % PORT_SPAN


def _slurm(env: Mapping[str, str], name: str) -> str:
    value = env.get(name, "")
    if not value:
        raise StepError(
            f"{name} is not set: this step runs only as a Slurm task (srun inside the "
            "TunePlane batch script)."
        )
    return value


def restart_count(env: Mapping[str, str]) -> int:
    """How many times Slurm requeued this job before this run: ``SLURM_RESTART_COUNT`` (absent
    or empty in the first run: 0)."""
    text = env.get("SLURM_RESTART_COUNT", "").strip()
    if not text:
        return 0
    if not text.isdigit():
        raise StepError(
            f"SLURM_RESTART_COUNT is {text!r}, not a count of requeues (0 or more); Slurm sets "
            "it, so remove it from the batch job's environment."
        )
    return int(text)


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list, as ``scontrol show hostnames`` expands it."""
    done = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30
    )
    hosts = done.stdout.split()
    if done.returncode != 0 or not hosts:
        raise StepError(
            f"`scontrol show hostnames {nodelist}` failed ({done.stderr.strip()}); the rendezvous "
            "address cannot be found without it."
        )
    return hosts[0]


def visible_gpus(env: Mapping[str, str], wanted: int) -> tuple[str, ...]:
    """The GPUs Slurm gave this task, as CUDA_VISIBLE_DEVICES names them.

    Slurm's gpu plugin names them in ``CUDA_VISIBLE_DEVICES`` (or ``SLURM_STEP_GPUS`` /
    ``SLURM_JOB_GPUS``) when its gres.conf ``File=`` entries are NVIDIA devices. When they are
    not (a cluster that counts GPUs without naming devices, as the test cluster's stand-in files
    do) Slurm only says how many (``SLURM_GPUS_ON_NODE``): then the step's ordinals are
    ``0..G-1``, which is right only where the node's GPUs are confined to the job (cgroups) or
    the job holds the whole node."""
    for name in ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        given = tuple(g for g in env.get(name, "").split(",") if g)
        if given:
            break
    else:
        counted = env.get("SLURM_GPUS_ON_NODE", "0")
        given = tuple(str(i) for i in range(wanted)) if counted == str(wanted) else ()
    if len(given) != wanted:
        raise StepError(
            f"Slurm gave this task the GPUs {given!r}, and the member wants {wanted}; check the "
            "node's gres.conf (Name=gpu with File=) so that GRES names the job's GPUs."
        )
    return given


def collector_argv(
    attempt: AttemptFile,
    folder: Path,
    index: int,
    restart: int,
    spool: Path,
    python: str = sys.executable,
) -> list[str] | None:
    """Member ``index``'s collector in the run after ``restart`` requeues, as a Node starts it
    (agent/collectors.py), shipping with the member's own credential (in the first run's member
    folder, read there by every run) and, after a requeue, with source ids that start with
    ``restart-<r>/``; None when the attempt names no telemetry gateway."""
    here = member_dir(folder, index, restart)
    out_dir = here / "out"
    credential = member_dir(folder, index) / CREDENTIAL_FILE
    if not attempt.gateways or not credential.exists():
        return None
    ca = here / "ca.pem"
    ca.write_text(attempt.ca_pem, encoding="utf-8")
    return [
        python, "-m", "tuneplane.collector.cli", "run",
        "--telemetry-dir", str(telemetry_dir(out_dir)), "--out-dir", str(out_dir),
        "--state-dir", str(spool),
        *(arg for gateway in attempt.gateways for arg in ("--gateway", gateway)),
        "--ca", str(ca), "--credential-file", str(credential),
        "--run-id", attempt.run_id, "--attempt", str(attempt.attempt), "--member", str(index),
        *(("--source-prefix", source_prefix(restart)) if restart else ()),
    ]  # fmt: skip


def run_with_collector(here: Path, argv: list[str] | None, spool: Path) -> int:
    """Run the member in the foreground beside its collector (when there is one); when the
    member has ended, tell the collector (``member-exited``, as a Node does) and give it
    :data:`DRAIN_TIMEOUT_S` to deliver what it holds. The member's status is returned."""
    if argv is None:
        shutil.rmtree(spool, ignore_errors=True)
        return run_in_foreground(here)
    with (here / "collector.log").open("ab") as log_file:
        collector = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT
        )
    try:
        code = run_in_foreground(here)
    finally:
        (spool / EXITED_MARKER).touch()
        try:
            collector.wait(DRAIN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            collector.terminate()
            collector.wait(DRAIN_TIMEOUT_S)
    if (spool / DRAINED_MARKER).exists():
        shutil.rmtree(spool, ignore_errors=True)
    else:
        print(f"tuneplane slurm step: the collector did not deliver everything in "
              f"{DRAIN_TIMEOUT_S:g} s; its spool stays in {spool} on this node.",
              file=sys.stderr)  # fmt: skip
    return code


class Placed(NamedTuple):
    """Where this node's member runs: its index, the run's restart count, its member folder."""

    member_index: int
    restart: int
    here: Path


def prepare_member(folder: Path, env: Mapping[str, str]) -> Placed:
    """Write this node's member (files, capsule, member.json) into its folder in this run of
    the Slurm job (:func:`restart_count`); say where it is."""
    attempt = read_attempt_file(folder)
    index, count = int(_slurm(env, "SLURM_NODEID")), int(_slurm(env, "SLURM_NNODES"))
    restart = restart_count(env)
    if count != attempt.member_count:
        raise StepError(
            f"the allocation has {count} nodes and the attempt {attempt.member_count} members; "
            "the batch script asks for one node per member, so this job was not submitted by "
            "TunePlane's coordinator."
        )
    addr = first_host(_slurm(env, "SLURM_JOB_NODELIST"))
    port = master_port(int(_slurm(env, "SLURM_JOB_ID")))
    spec = jobspec.loads(attempt.jobspec_json)
    capsule = {name: text.encode("utf-8") for name, text in attempt.capsule.items()}
    here = member_dir(folder, index, restart)
    work = materialise(
        here, attempt.jobspec_json, capsule, attempt.capsule_digests, spec.source_files
    )
    launch = read_capsule(work)
    out_dir = here / "out"
    for made in (out_dir, telemetry_dir(out_dir), tensorboard_dir(out_dir)):
        made.mkdir(parents=True, exist_ok=True)
    ours = member_env(
        attempt.run_id, attempt.attempt, index, count, out_dir, telemetry_dir(out_dir),
        tensorboard_dir(out_dir), spec.parameter_env,
    )  # fmt: skip
    gpus = visible_gpus(env, attempt.gpus_per_member)
    image = image_of(spec.runtime_id)
    wrapper: tuple[str, ...] = ()
    if image is None:
        base_env = workload_env(spec.env, ours, env.get("PATH") or DEFAULT_PATH, str(work))
        entrypoint = tuple(launch.entrypoint)
    else:
        planned = plan_image(attempt, image, work, out_dir, launch.entrypoint, spec.env, ours)
        base_env, entrypoint, wrapper = planned.env, planned.entrypoint, planned.wrapper
    processes = plan_processes(
        launch.launcher, entrypoint, gpus, index, count, addr, port, base_env, work
    )
    write_launch(
        MemberLaunch(
            member_dir=here,
            run_id=attempt.run_id,
            attempt=attempt.attempt,
            member_index=index,
            processes=processes,
            out_dir=out_dir,
            grace_period_s=spec.grace_period_s,
            stdout_path=here / "stdout.log",
            stderr_path=here / "stderr.log",
            sandbox_argv=wrapper,
            sdk_path=work / CAPSULE_DIR / runner_pyz.RUNNER_PYZ,
        )
    )
    return Placed(index, restart, here)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m tuneplane.agent.slurm_step <attempt folder>", file=sys.stderr)
        return EXIT_USAGE
    try:
        folder = Path(args[0])
        placed = prepare_member(folder, os.environ)
        attempt = read_attempt_file(folder)
    except (
        StepError,
        SlurmImageError,
        AttemptFileError,
        PrepareRefused,
        LaunchPlanError,
        jobspec.JobSpecError,
    ) as exc:
        print(f"tuneplane slurm step: {exc}", file=sys.stderr)
        return EXIT_SETUP_FAILED
    # The collector's spool is private and on this node (DESIGN.md: host-local), never shared.
    if attempt.spool_dir:
        Path(attempt.spool_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
    spool = Path(
        tempfile.mkdtemp(prefix=f"tp-collector-{attempt.run_id}-", dir=attempt.spool_dir or None)
    )
    argv = collector_argv(attempt, folder, placed.member_index, placed.restart, spool)
    return run_with_collector(placed.here, argv, spool)


if __name__ == "__main__":
    sys.exit(main())
