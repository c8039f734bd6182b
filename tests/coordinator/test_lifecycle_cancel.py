"""Cancel and retry in the Job lifecycle tables (pure functions)."""

from __future__ import annotations

import pytest

from tuneplane.coordinator import lifecycle as lc
from tuneplane.coordinator.lifecycle import MemberFacts, derive_job_state

RUNNING = MemberFacts(0, lc.M_RUNNING)
KILLED = MemberFacts(1, lc.M_EXITED, has_exit=True, signal=15)
OK = MemberFacts(1, lc.M_EXITED, has_exit=True)


def test_a_cancelled_attempt_is_cancelling_until_every_member_ended() -> None:
    why = "cancelled by ada"
    state, reason = derive_job_state(lc.COMMIT, "", [RUNNING, KILLED], why)
    assert state == lc.CANCELLING and reason.startswith(why)
    # A member ended by the cancel's SIGTERM is not a failure, and exiting 0 is not a success.
    assert derive_job_state(lc.COMMIT, "", [KILLED, OK], why) == (lc.CANCELLED, why)
    assert derive_job_state(None, "aborted", [MemberFacts(0, lc.M_ABORTED)], why)[0] == (
        lc.CANCELLED
    )
    assert derive_job_state(lc.COMMIT, "", [MemberFacts(0, lc.M_UNKNOWN)], why)[0] == (
        lc.CANCELLING
    )


def test_cancelling_only_ends_cancelled() -> None:
    assert lc.next_job_state(lc.CANCELLING, lc.CANCELLED) == lc.CANCELLED
    with pytest.raises(lc.IllegalTransition):
        lc.next_job_state(lc.CANCELLING, lc.FAILED)
    assert lc.next_job_state(lc.CANCELLED, lc.FAILED) == lc.CANCELLED


def test_a_queued_retry_ignores_its_previous_attempt() -> None:
    for derived in (lc.FAILED, lc.UNKNOWN, lc.RUNNING, lc.CANCELLED):
        assert lc.next_job_state(lc.QUEUED, derived) == lc.QUEUED
    assert lc.next_job_state(lc.QUEUED, lc.RESERVED) == lc.RESERVED


def test_only_an_ended_job_that_did_not_succeed_may_be_retried() -> None:
    for state in (lc.FAILED, lc.CANCELLED, lc.ABORTED):
        lc.check_retry("run-1", state)
        lc.check_job_move(state, lc.QUEUED)
    with pytest.raises(lc.NotRetryable, match="Submit the experiment again"):
        lc.check_retry("run-1", lc.SUCCEEDED)
    for state in (lc.QUEUED, lc.RUNNING, lc.CANCELLING):
        with pytest.raises(lc.NotRetryable, match="has not ended"):
            lc.check_retry("run-1", state)
