"""The pure core of an attempt run as a Slurm job (coordinator/slurm_attempt.py): the Job state
each Slurm answer means, a cancel's steps, the job's shape and its batch script."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tuneplane.coordinator.executors.slurm import SLURM_TO_JOB_STATE
from tuneplane.coordinator.lifecycle.states import (
    CANCELLED,
    CANCELLING,
    FAILED,
    JOB_TRANSITIONS,
    RESERVED,
    RUNNING,
    STARTING,
    SUCCEEDED,
    UNKNOWN,
)
from tuneplane.coordinator.slurm_attempt import (
    ADOPT,
    CANCEL,
    NEVER,
    SIGNAL,
    SUBMIT,
    MemberExit,
    SlurmAttemptFacts,
    batch_script,
    cancel_step,
    derive_job_state,
    first_failure,
    job_request,
    member_exit,
    member_state,
    next_poll_s,
    shape,
    submission,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.sqlite_only("pure: no store")]

WORDS = [*sorted(SLURM_TO_JOB_STATE), "", "SOMETHING_NEW"]
facts = st.builds(
    SlurmAttemptFacts,
    job_id=st.none() | st.integers(1, 10**6),
    slurm_state=st.sampled_from(WORDS),
    slurm_reason=st.sampled_from(["", "None", "Resources", "refused: no such partition"]),
    reachable=st.booleans(),
    unreachable_why=st.just("slurmrestd at http://x did not answer."),
    has_exit=st.booleans(),
    exit_code=st.integers(0, 255),
    signal=st.integers(0, 64),
)


def running(**extra: Any) -> SlurmAttemptFacts:
    """A Slurm job 7 that was running, with ``extra`` facts changed."""
    return attrs.evolve(SlurmAttemptFacts(job_id=7, slurm_state="RUNNING"), **extra)


@pytest.mark.parametrize(
    ("f", "state", "says"),
    [
        (SlurmAttemptFacts(), RESERVED, "submitting it to Slurm"),
        (SlurmAttemptFacts(job_id=7, slurm_state="PENDING", slurm_reason="Resources"), RESERVED,
         "Slurm job 7 is pending in Slurm (Resources)"),
        (SlurmAttemptFacts(job_id=7, slurm_state="CONFIGURING"), STARTING, "configuring"),
        (running(), RUNNING, "Slurm job 7 is running"),
        (running(slurm_state="COMPLETED", has_exit=True), SUCCEEDED, "completed"),
        (running(slurm_state="FAILED", has_exit=True, exit_code=3), FAILED,
         "ended FAILED (its members exited with code 3)"),
        (running(slurm_state="TIMEOUT", has_exit=True, exit_code=143, signal=15), FAILED,
         "ended by signal 15"),
        (running(slurm_state="OUT_OF_MEMORY"), FAILED, "ran out of memory"),
        (running(slurm_state="NODE_FAIL"), FAILED, "node of the Slurm job's allocation failed"),
        (running(slurm_state="PREEMPTED"), FAILED, "preempted"),
        (running(slurm_state="CANCELLED"), CANCELLED, "cancelled in Slurm, not through"),
        (running(reachable=False, unreachable_why="gone."), UNKNOWN,
         "slurmrestd does not answer (gone)"),
        (SlurmAttemptFacts(slurm_state="FAILED", slurm_reason="Slurm refused to submit."),
         FAILED, "Slurm refused to submit"),
        (running(slurm_state="SOMETHING_NEW"), UNKNOWN, "not known here"),
    ],
)  # fmt: skip
def test_each_slurm_answer_means_one_job_state(f: SlurmAttemptFacts, state: str, says: str) -> None:
    derived, reason = derive_job_state(f, None)
    assert derived == state and says in reason


def test_the_reason_names_the_member_that_failed_first_not_sruns_largest_code() -> None:
    # Member 1 exited 7; Slurm then stopped member 0 (143), and srun's code is the largest.
    ended = running(slurm_state="FAILED", has_exit=True, exit_code=143)
    exits = [MemberExit(0, True, 143, 0, 2_000), MemberExit(1, True, 7, 0, 1_000)]
    state, reason = derive_job_state(ended, None, exits)
    assert state == FAILED
    assert reason.startswith("Slurm job 7 ended FAILED (member 1 failed first; it exited with "
                             "code 7): ")  # fmt: skip
    by_signal = [MemberExit(0, True, 0, 9, 5), MemberExit(1, False)]
    assert (
        "member 0 failed first; it ended by signal 9" in derive_job_state(ended, None, by_signal)[1]
    )
    # No failed member (or none recorded): Slurm's own exit code, as before.
    assert (
        "(its members exited with code 143)"
        in derive_job_state(ended, None, [MemberExit(0, True, 0, 0, 1), MemberExit(1, False)])[1]
    )


@given(st.lists(st.builds(MemberExit, index=st.integers(0, 7), has_exit=st.booleans(),
                          exit_code=st.integers(0, 3), signal=st.sampled_from([0, 0, 9, 15]),
                          ended_at_ms=st.integers(0, 5))))  # fmt: skip
def test_the_first_failure_is_the_earliest_failed_member(exits: list[MemberExit]) -> None:
    first = first_failure(exits)
    failed = [e for e in exits if e.has_exit and (e.exit_code or e.signal)]
    if not failed:
        assert first is None
        return
    assert first in failed
    assert all((first.ended_at_ms, first.index) <= (e.ended_at_ms, e.index) for e in failed)


def test_a_cancel_is_cancelling_until_slurm_says_the_job_ended() -> None:
    assert derive_job_state(running(), "cancelled by ana") == (
        CANCELLING,
        "cancelled by ana; waiting for the Slurm job to end",
    )
    # slurmrestd down does not end a cancel: the job may still run.
    assert derive_job_state(running(reachable=False), "cancelled by ana")[0] == CANCELLING
    for end in ("FAILED", "CANCELLED", "COMPLETED"):
        assert derive_job_state(running(slurm_state=end), "cancelled by ana") == (
            CANCELLED,
            "cancelled by ana",
        )


@given(facts, st.none() | st.just("cancelled by ana"))
def test_unreachable_is_never_failed_and_every_state_is_a_job_state(
    f: SlurmAttemptFacts, cancel: str | None
) -> None:
    state, reason = derive_job_state(f, cancel)
    assert state in JOB_TRANSITIONS and reason
    if not f.reachable and cancel is None:
        assert state == UNKNOWN
    if cancel is not None:
        assert state in (CANCELLING, CANCELLED)


@given(
    st.none() | st.integers(0, 10**6), st.none() | st.integers(0, 10**6), st.integers(0, 600),
    st.integers(0, 2 * 10**6),
)  # fmt: skip
def test_a_cancel_signals_once_then_cancels_once_after_the_grace_period(
    signalled: int | None, cancelled: int | None, grace: int, now: int
) -> None:
    step = cancel_step(signalled, cancelled, grace, now)
    if signalled is None:
        assert step == SIGNAL
    elif cancelled is None and now >= signalled + grace * 1000:
        assert step == CANCEL
    else:
        assert step is None


@given(st.lists(st.integers(1, 10**6), unique=True, max_size=3), st.booleans())
def test_a_job_slurm_holds_under_the_name_is_adopted_never_submitted_again(
    found: list[int], cancelled: bool
) -> None:
    what, job_id = submission(found, cancelled)
    if found:
        assert (what, job_id) == (ADOPT, min(found))
    else:
        assert (what, job_id) == ((NEVER if cancelled else SUBMIT), None)


def test_the_shape_is_one_member_per_node() -> None:
    assert shape(8, None, None) == (1, 8)
    assert shape(8, 2, None) == (2, 4)
    assert shape(8, 2, 4) == (2, 4)
    assert shape(0, None, None) == (1, 0)
    assert shape(8, None, 2) == (4, 2)


def test_the_batch_script_runs_the_step_once_per_node_quoted() -> None:
    folder = Path("/shared/tp/run-1/attempt-2")
    script = batch_script("/opt/py env/bin/python3", folder)
    assert script.startswith("#!/bin/sh\n")
    assert script.endswith(
        "exec srun --ntasks-per-node=1 --kill-on-bad-exit=1 '/opt/py env/bin/python3' -m "
        "tuneplane.agent.slurm_step /shared/tp/run-1/attempt-2\n"
    )
    request = job_request("run-1", 2, "gpu", "python3", folder, 2, 4)
    assert (request.name, request.nodes, request.gpus_per_node) == ("tp-run-1-a2", 2, 4)
    assert request.working_directory == str(folder) and request.partition == "gpu"
    assert request.standard_output == str(folder / "slurm-%j.out")


FAST, SLOW = 0.05, 1.0


@given(st.lists(st.booleans(), max_size=40))
def test_polls_are_fast_after_a_change_and_double_to_the_tick(changes: list[bool]) -> None:
    interval = SLOW
    quiet: int | None = None  # quiet passes since the last change; None before any change
    for changed in changes:
        interval = next_poll_s(interval, changed, True, FAST, SLOW)
        quiet = 0 if changed else (None if quiet is None else quiet + 1)
        expected = SLOW if quiet is None else min(SLOW, FAST * 2**quiet)
        assert interval == pytest.approx(expected)
    assert next_poll_s(FAST, True, False, FAST, SLOW) == SLOW  # nothing live: the tick


def test_the_poll_interval_after_a_change_then_quiet_passes() -> None:
    seen = [next_poll_s(SLOW, True, True, FAST, SLOW)]
    for _ in range(6):
        seen.append(next_poll_s(seen[-1], False, True, FAST, SLOW))
    assert seen == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]


def test_a_requeued_pending_job_is_reserved_and_says_it_was_requeued() -> None:
    facts = SlurmAttemptFacts(job_id=7, slurm_state="PENDING", slurm_reason="BeginTime",
                              restarts=2)  # fmt: skip
    assert derive_job_state(facts, None) == (
        RESERVED,
        "Slurm job 7 was requeued by Slurm (2 times) and is pending again (BeginTime)",
    )
    assert RESERVED in JOB_TRANSITIONS[RUNNING] and RESERVED in JOB_TRANSITIONS[STARTING]


def test_a_members_exit_comes_from_its_runners_record_or_is_absent() -> None:
    assert member_exit(1, 3, None, 12.5) == attrs.evolve(member_exit(1, 0, 0, 12.5), exit_code=3)
    assert member_exit(0, None, 9, 1.0).signal == 9 and member_exit(0, None, 9, 1.0).has_exit
    assert not member_exit(2, None, None, None).has_exit
    assert (member_state("", False), member_state("PENDING", False)) == ("reserved", "reserved")
    assert (member_state("RUNNING", False), member_state("FAILED", True)) == ("running", "exited")
