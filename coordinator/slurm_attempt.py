"""An attempt run as one Slurm job: its shape, its batch script, the Job state Slurm's answers
mean, and the next step of a cancel. Pure: no clock, no store, no slurmrestd.

Theory of operation: the coordinator writes the attempt (and its ``slurm_attempts`` row, named by
:func:`~tuneplane.proto.contract.slurm_attempt.job_name`) before it submits; the Slurm job id is
recorded after; Slurm's word is recorded at each poll. The Job's state is derived from that row
alone (:func:`derive_job_state`), as a Node attempt's is derived from its members:

- a submission slurmctld refused: ``failed``, with Slurm's words;
- not submitted yet, or Slurm holding it pending: ``reserved`` (a Job never goes back to
  ``queued``; the reason says Slurm's own reason for waiting); a job Slurm requeued after it
  ran is pending again, so a running Job goes back to ``reserved``, and the reason says it was
  requeued (when Slurm starts it again it is ``starting``/``running`` again: each run has its
  own member folders, see tuneplane.proto.contract.slurm_attempt);
- slurmrestd not answering: ``unknown`` (never ``failed``) until it answers again;
- a person's cancel: ``cancelling`` until Slurm says the job ended, then ``cancelled``;
- otherwise Slurm's word read by :func:`~tuneplane.coordinator.executors.slurm.job_state`.

A cancel is a SIGTERM first (the workload's runner passes it on and waits its grace period),
then Slurm's cancel once the Job's grace period has passed (:func:`cancel_step`).
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

import attrs

from tuneplane.proto.contract.slurm_attempt import job_name

from .executors.slurm import JobRequest, failure_reason, job_state
from .lifecycle.states import (
    CANCELLED,
    CANCELLING,
    FAILED,
    M_EXITED,
    M_RESERVED,
    M_RUNNING,
    QUEUED,
    RESERVED,
    RUNNING,
    STARTING,
    SUCCEEDED,
    UNKNOWN,
)

#: The step every node runs (one task per node), as a module of the installed package.
STEP_MODULE = "tuneplane.agent.slurm_step"
#: The environment of the batch script: Slurm adds its own SLURM_* names; nothing else leaks in.
BATCH_PATH = "/usr/local/bin:/usr/bin:/bin"
SIGTERM = 15
SIGNAL = "signal"
CANCEL = "cancel"
ADOPT = "adopt"
SUBMIT = "submit"
NEVER = "never-submit"


@attrs.frozen
class SlurmAttemptFacts:
    """What the store holds about an attempt run as a Slurm job."""

    job_id: int | None = None  # None until recorded
    slurm_state: str = ""  # Slurm's last word; "" before its first answer
    slurm_reason: str = ""
    reachable: bool = True
    unreachable_why: str = ""
    has_exit: bool = False
    exit_code: int = 0
    signal: int = 0
    restarts: int = 0  # how many times Slurm requeued the job


@attrs.frozen
class MemberExit:
    """How one member of a Slurm attempt ended, from its runner's exit record (``has_exit``
    False: it left none)."""

    index: int
    has_exit: bool
    exit_code: int = 0
    signal: int = 0
    ended_at_ms: int = 0


def member_exit(
    index: int, exit_code: int | None, signal: int | None, finished_at_s: float | None
) -> MemberExit:
    """A member's exit from its runner's record (None for each when it left none)."""
    if finished_at_s is None:
        return MemberExit(index, False)
    return MemberExit(index, True, exit_code or 0, signal or 0, int(finished_at_s * 1000))


def member_state(slurm_state: str, ended: bool) -> str:
    """A member of a Slurm attempt in a member's words: ``exited`` once the job ended,
    ``reserved`` until Slurm runs it, else ``running``."""
    if ended:
        return M_EXITED
    return M_RESERVED if slurm_state in ("", "PENDING") else M_RUNNING


def shape(gpus: int, members: int | None, gpus_per_member: int | None) -> tuple[int, int]:
    """(Slurm nodes, GPUs per node) of a Job: one member per node."""
    if members and gpus_per_member is not None:
        return members, gpus_per_member
    if members:
        return members, gpus // members
    if gpus_per_member:
        return max(1, gpus // gpus_per_member), gpus_per_member
    return 1, gpus


def first_failure(exits: Sequence[MemberExit]) -> MemberExit | None:
    """The member that failed first (a non-zero code or a signal; the earliest end, then the
    lowest index), as on Nodes; None when none did."""
    failed = [e for e in exits if e.has_exit and (e.exit_code or e.signal)]
    return min(failed, key=lambda e: (e.ended_at_ms, e.index), default=None)


def _exit_words(facts: SlurmAttemptFacts, exits: Sequence[MemberExit]) -> str:
    first = first_failure(exits)
    if first is not None:
        # Slurm's own exit code is srun's largest, often a member that the failure stopped.
        how = f"ended by signal {first.signal}" if first.signal else (
            f"exited with code {first.exit_code}")  # fmt: skip
        return f" (member {first.index} failed first; it {how})"
    if not facts.has_exit:
        return ""
    if facts.signal:
        return f" (its members ended by signal {facts.signal})"
    return f" (its members exited with code {facts.exit_code})"


def derive_job_state(
    facts: SlurmAttemptFacts, cancel_reason: str | None, exits: Sequence[MemberExit] = ()
) -> tuple[str, str]:
    """The Job's state and reason from its Slurm attempt (see the module's theory) and, once
    it ended, its members' recorded exits (the reason names the first failure)."""
    said = job_state(facts.slurm_state) if facts.slurm_state else ""
    ended = said in (SUCCEEDED, FAILED, CANCELLED)
    if cancel_reason is not None:
        if ended:
            return CANCELLED, cancel_reason
        return CANCELLING, f"{cancel_reason}; waiting for the Slurm job to end"
    if not facts.reachable:
        return UNKNOWN, f"slurmrestd does not answer ({facts.unreachable_why.rstrip('.')})"
    if not facts.slurm_state:
        return RESERVED, "the attempt is recorded; submitting it to Slurm"
    if facts.job_id is None:
        # A word with no job: slurmctld refused the submission and said why.
        return FAILED, facts.slurm_reason.rstrip(".") or "Slurm refused the job"
    job = f"Slurm job {facts.job_id}"
    if said == QUEUED:
        why = facts.slurm_reason if facts.slurm_reason not in ("", "None") else "no reason given"
        if facts.restarts:
            # Requeued after it ran (by Slurm or an operator): waiting again, and says so.
            return RESERVED, f"{job} was requeued by Slurm ({facts.restarts} time" + (
                "s" * (facts.restarts != 1)) + f") and is pending again ({why})"  # fmt: skip
        return RESERVED, f"{job} is pending in Slurm ({why})"
    if said == STARTING:
        return STARTING, f"{job} is configuring its nodes"
    if said == RUNNING:
        return RUNNING, f"{job} is {facts.slurm_state.lower()}"
    if said == SUCCEEDED:
        return SUCCEEDED, f"{job} completed{_exit_words(facts, exits)}"
    if said == CANCELLED:
        return CANCELLED, f"{job} was cancelled in Slurm, not through TunePlane"
    if said == FAILED:
        why = failure_reason(facts.slurm_state) or f"Slurm ended it as {facts.slurm_state}."
        return FAILED, f"{job} ended {facts.slurm_state}{_exit_words(facts, exits)}: {why}"
    return UNKNOWN, f"{job} is in the Slurm state {facts.slurm_state!r}, which is not known here"


def submission(found_job_ids: Sequence[int], cancelled: bool) -> tuple[str, int | None]:
    """What to do with an attempt whose Slurm job id is not recorded, given the ids of the jobs
    Slurm holds under its name: :data:`ADOPT` the oldest (a submit whose record was lost: never
    a second job), :data:`NEVER` submit one when a cancel came first, else :data:`SUBMIT`."""
    if found_job_ids:
        return ADOPT, min(found_job_ids)
    if cancelled:
        return NEVER, None
    return SUBMIT, None


def next_poll_s(
    last_s: float, changed: bool, live: bool, fastest_s: float, slowest_s: float
) -> float:
    """How long the executor waits before its next pass: soon after a change (a Job woken,
    submitted, cancelled, or Slurm saying something new), doubling while nothing changes, up to
    ``slowest_s``; ``slowest_s`` when nothing is live."""
    if not live:
        return slowest_s
    if changed:
        return fastest_s
    return min(slowest_s, max(fastest_s, last_s * 2))


def cancel_step(
    signalled_at_ms: int | None, cancelled_at_ms: int | None, grace_period_s: int, now_ms: int
) -> str | None:
    """What a cancelled, running Slurm attempt needs now: :data:`SIGNAL` (SIGTERM, once),
    :data:`CANCEL` (Slurm's cancel, once the grace period has passed), or None."""
    if signalled_at_ms is None:
        return SIGNAL
    if cancelled_at_ms is None and now_ms >= signalled_at_ms + grace_period_s * 1000:
        return CANCEL
    return None


def batch_script(python: str, attempt_folder: Path) -> str:
    """The batch script: one srun step, one task per node, each running the Slurm step."""
    step = " ".join(shlex.quote(a) for a in (python, "-m", STEP_MODULE, str(attempt_folder)))
    return (
        "#!/bin/sh\n"
        "# A TunePlane attempt, written by the coordinator: the Slurm step on every node.\n"
        f"exec srun --ntasks-per-node=1 --kill-on-bad-exit=1 {step}\n"
    )


def job_request(
    run_id: str,
    attempt: int,
    partition: str,
    python: str,
    attempt_folder: Path,
    nodes: int,
    gpus_per_node: int,
    gpu_type: str = "",
    constraint: str = "",
) -> JobRequest:
    """The Slurm job of one attempt: N nodes, G GPUs each (GRES, of ``gpu_type`` when given),
    one task per node, on nodes with the feature ``constraint`` when given."""
    return JobRequest(
        name=job_name(run_id, attempt),
        partition=partition,
        script=batch_script(python, attempt_folder),
        working_directory=str(attempt_folder),
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        gpu_type=gpu_type,
        constraint=constraint,
        environment={"PATH": BATCH_PATH, "LANG": "C.UTF-8"},
        standard_output=str(attempt_folder / "slurm-%j.out"),
    )
