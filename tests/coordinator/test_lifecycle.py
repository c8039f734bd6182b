"""The Job and member lifecycle tables."""

from __future__ import annotations

import pytest

from tuneplane.coordinator import lifecycle as lc
from tuneplane.coordinator.lifecycle import MemberFacts, derive_job_state


def test_terminal_job_states_never_change() -> None:
    for state in lc.TERMINAL_JOB_STATES:
        for other in lc.JOB_TRANSITIONS:
            assert lc.next_job_state(state, other) == state


def test_an_illegal_job_move_is_a_typed_error() -> None:
    with pytest.raises(lc.IllegalTransition):
        lc.check_job_move(lc.QUEUED, lc.RUNNING)


def test_member_reports_only_move_forward() -> None:
    assert lc.member_after_report(lc.M_RUNNING, lc.M_PREPARED) is None
    assert lc.member_after_report(lc.M_RUNNING, lc.M_RUNNING) is None
    assert lc.member_after_report(lc.M_PREPARED, lc.M_RUNNING) == lc.M_RUNNING
    assert lc.member_after_report(lc.M_EXITED, lc.M_LOST) is None
    with pytest.raises(lc.IllegalTransition):
        lc.member_after_report(lc.M_RUNNING, "unknown")


def test_job_state_from_members() -> None:
    running = MemberFacts(0, lc.M_RUNNING)
    ok = MemberFacts(1, lc.M_EXITED, has_exit=True)
    bad = MemberFacts(1, lc.M_EXITED, has_exit=True, exit_code=3)
    killed = MemberFacts(1, lc.M_EXITED, has_exit=True, signal=9)
    gone = MemberFacts(1, lc.M_UNKNOWN)
    assert derive_job_state(None, "", [])[0] == lc.QUEUED
    assert derive_job_state(None, "", [MemberFacts(0, lc.M_RESERVED)])[0] == lc.RESERVED
    assert derive_job_state(lc.ABORT, "why", [running]) == (lc.ABORTED, "why")
    assert derive_job_state(lc.COMMIT, "", [running, ok])[0] == lc.RUNNING
    assert derive_job_state(lc.COMMIT, "", [ok, ok])[0] == lc.SUCCEEDED
    assert derive_job_state(lc.COMMIT, "", [running, bad]) == (
        lc.FAILED,
        "member 1 exited with code 3",
    )
    assert derive_job_state(lc.COMMIT, "", [running, killed])[1] == "member 1 was ended by signal 9"
    assert derive_job_state(lc.COMMIT, "", [running, gone])[0] == lc.UNKNOWN
    assert derive_job_state(lc.COMMIT, "", [MemberFacts(0, lc.M_PREPARED)])[0] == lc.STARTING


def test_a_launch_is_reserved_then_preparing_until_the_commit_decision() -> None:
    reserved = [MemberFacts(0, lc.M_RESERVED), MemberFacts(1, lc.M_RESERVED)]
    assert derive_job_state(None, "", reserved)[0] == lc.RESERVED
    issued = [MemberFacts(0, lc.M_PREPARED), MemberFacts(1, lc.M_PREPARING)]
    state, reason = derive_job_state(None, "", issued)
    assert (state, reason.endswith("1 of 2 prepared")) == (lc.PREPARING, True)
    assert lc.next_job_state(lc.QUEUED, lc.RESERVED) == lc.RESERVED
    assert lc.next_job_state(lc.RESERVED, lc.PREPARING) == lc.PREPARING
    assert lc.next_job_state(lc.PREPARING, lc.STARTING) == lc.STARTING
    assert lc.next_job_state(lc.PREPARING, lc.ABORTED) == lc.ABORTED
    with pytest.raises(lc.IllegalTransition):
        lc.check_job_move(lc.PREPARING, lc.QUEUED)
