"""Slurm job states read as TunePlane Job states: a table, not branches.

Theory of operation: slurmctld reports one word per job (``job_state`` in slurmrestd's answers;
a flag such as COMPLETING or CONFIGURING replaces the base state while it is set). Each word
that Slurm 22.05 can report is a key of :data:`SLURM_TO_JOB_STATE`; any other word (a newer
Slurm's, or garbage) and a Slurm that cannot be asked map to ``unknown``, never to ``failed``:
not knowing is not evidence of failure (the same rule as a Node whose connection dropped).

- Waiting for resources (PENDING, and a job Slurm requeued) is ``queued``: TunePlane's word for
  "admitted, waiting for free GPUs". CONFIGURING (nodes booting for it) is ``starting``.
- RUNNING, and COMPLETING (its processes are ending; how they ended is not known yet),
  SUSPENDED, SIGNALING and STAGE_OUT (the job still holds its allocation) are ``running``.
- COMPLETED is ``succeeded``; CANCELLED is ``cancelled``; every other end (FAILED, TIMEOUT,
  NODE_FAIL, PREEMPTED, OUT_OF_MEMORY, BOOT_FAIL, DEADLINE, and the holds and revocations that
  end a job here) is ``failed``, with :data:`FAILURE_REASONS` saying why in a sentence.
"""

from __future__ import annotations

from tuneplane.coordinator.lifecycle.states import (
    CANCELLED,
    FAILED,
    QUEUED,
    RUNNING,
    STARTING,
    SUCCEEDED,
    UNKNOWN,
)

from ._values import ExitStatus, SlurmJob

SLURM_TO_JOB_STATE: dict[str, str] = {
    "PENDING": QUEUED,
    "REQUEUED": QUEUED,
    "REQUEUE_FED": QUEUED,
    "CONFIGURING": STARTING,
    "RUNNING": RUNNING,
    "COMPLETING": RUNNING,
    "SUSPENDED": RUNNING,
    "SIGNALING": RUNNING,
    "STAGE_OUT": RUNNING,
    "RESIZING": RUNNING,
    "COMPLETED": SUCCEEDED,
    "CANCELLED": CANCELLED,
    "FAILED": FAILED,
    "TIMEOUT": FAILED,
    "NODE_FAIL": FAILED,
    "PREEMPTED": FAILED,
    "OUT_OF_MEMORY": FAILED,
    "BOOT_FAIL": FAILED,
    "DEADLINE": FAILED,
    # Held after a requeue, or by a deleted reservation: it will not run without a person.
    "REQUEUE_HOLD": FAILED,
    "RESV_DEL_HOLD": FAILED,
    "SPECIAL_EXIT": FAILED,
    "REVOKED": FAILED,
    "STOPPED": FAILED,
}

#: Why a Slurm job that ended as ``failed`` failed, as a sentence for ``tp status``.
FAILURE_REASONS: dict[str, str] = {
    "FAILED": "The Slurm job's script exited with a non-zero code.",
    "TIMEOUT": "Slurm ended the job at its time limit; ask for a longer one.",
    "NODE_FAIL": "A node of the Slurm job's allocation failed; retry the Job.",
    "PREEMPTED": "Slurm preempted the job for another; retry the Job.",
    "OUT_OF_MEMORY": "The Slurm job ran out of memory; ask for more or use less.",
    "BOOT_FAIL": "A node of the Slurm job's allocation failed to boot; retry the Job.",
    "DEADLINE": "Slurm ended the job at its deadline before it could run.",
    "REQUEUE_HOLD": "Slurm requeued the job and holds it; release it in Slurm or retry the Job.",
    "RESV_DEL_HOLD": "The Slurm reservation the job waited for was deleted; retry the Job.",
    "SPECIAL_EXIT": "The Slurm job ended in Slurm's special-exit state; retry the Job.",
    "REVOKED": "Slurm revoked the job (federation); retry the Job.",
    "STOPPED": "The Slurm job was stopped; retry the Job.",
}


def job_state(slurm_state: str | None) -> str:
    """The TunePlane Job state for Slurm's word; None (slurmrestd could not be asked) and a
    word this table does not know are ``unknown``."""
    if slurm_state is None:
        return UNKNOWN
    return SLURM_TO_JOB_STATE.get(slurm_state.strip().upper(), UNKNOWN)


def observed_state(job: SlurmJob | None) -> str:
    """The TunePlane Job state of what slurmrestd reported (None: nothing could be read)."""
    return job_state(None if job is None else job.slurm_state)


def failure_reason(slurm_state: str) -> str | None:
    """A sentence saying why a job in ``slurm_state`` failed; None for a state that is not a
    failure."""
    return FAILURE_REASONS.get(slurm_state.strip().upper())


def exit_status(wait_status: int) -> ExitStatus:
    """Read the wait(2) status slurmrestd v0.0.36-v0.0.38 report as ``exit_code`` (exit 3 is
    768, SIGTERM is 15): the exit code in bits 8-15, a terminating signal in bits 0-6."""
    if wait_status < 0:
        raise ValueError(f"a wait status is never negative, got {wait_status}")
    signal = wait_status & 0x7F
    if signal:
        return ExitStatus(code=128 + signal, signal=signal)
    return ExitStatus(code=(wait_status >> 8) & 0xFF)
