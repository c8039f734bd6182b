"""A Job's state derived from its attempt's decision and members, and the retry rule.

Rules:
- The Job's state is *derived* from its attempt's decision and members (:func:`derive_job_state`);
  a lost connection never makes a Job ``failed``. A committed member its Node could not start
  (``aborted`` after Commit) fails the Job with the Node's sentence: nothing waits for it.
- Terminal Job states are sticky (:func:`next_job_state`); while a retried Job waits, news of its
  previous attempt never moves it. Only an ended Job that did not succeed may be retried
  (:func:`check_retry`).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from .states import (
    ABORT,
    ABORTED,
    CANCELLED,
    CANCELLING,
    COMMIT,
    FAILED,
    M_ABORTED,
    M_CANCELLING,
    M_EXITED,
    M_LOST,
    M_PREPARED,
    M_RESERVED,
    M_RUNNING,
    M_UNKNOWN,
    PREPARING,
    QUEUED,
    RESERVED,
    RETRYABLE,
    RUNNING,
    STARTING,
    SUCCEEDED,
    TERMINAL_JOB_STATES,
    TERMINAL_MEMBER_STATES,
    UNKNOWN,
    IllegalTransition,
    check_job_move,
)


@attrs.frozen
class MemberFacts:
    """What :func:`derive_job_state` needs to know about one member."""

    index: int
    state: str  # the visible state: ``unknown`` while its Node is disconnected
    has_exit: bool = False
    exit_code: int = 0
    signal: int = 0
    reason: str = ""  # why it is in ``state``, as its Node (or the coordinator) said
    declared_lost: str = ""  # the declaration's sentence when its Node was declared lost


def describe_failure(m: MemberFacts) -> str | None:
    if m.state == M_LOST and m.declared_lost:
        return f"member {m.index} was {m.declared_lost.rstrip('.')}"
    if m.state == M_LOST:
        return f"member {m.index} was lost by its Node"
    if m.state == M_EXITED and m.has_exit and (m.exit_code != 0 or m.signal != 0):
        if m.signal:
            return f"member {m.index} was ended by signal {m.signal}"
        return f"member {m.index} exited with code {m.exit_code}"
    return None


def describe_launch_failure(m: MemberFacts) -> str | None:
    """A committed member that ended ``aborted``: its Node could not start it."""
    if m.state != M_ABORTED:
        return None
    why = m.reason.strip().rstrip(".") or "no reason given"
    return f"member {m.index} could not be started on its Node: {why}"


def failure_sentence(m: MemberFacts) -> str | None:
    """How a member of a committed attempt failed (an exit, a signal, lost, not started), or
    None when it did not fail: the one test of "this member failed"."""
    return describe_failure(m) or describe_launch_failure(m)


def derive_job_state(
    decision: str | None,
    decision_reason: str,
    members: Sequence[MemberFacts],
    cancel_reason: str | None = None,
) -> tuple[str, str]:
    """The Job's state and the reason for it, from its latest attempt.

    No members means no attempt yet: ``queued``. ``cancel_reason`` is set when a person cancelled
    this attempt: it is ``cancelling`` until every member has ended, then ``cancelled``.
    """
    if not members:
        return QUEUED, "waiting for free GPUs"
    if cancel_reason is not None:
        if decision == ABORT or all(m.state in TERMINAL_MEMBER_STATES for m in members):
            return CANCELLED, cancel_reason
        return CANCELLING, f"{cancel_reason}; waiting for every member to stop"
    if decision == ABORT:
        return ABORTED, decision_reason
    # A workload's own failure explains more than a sibling stopped because of it, so exits and
    # losses are named first, then members their Node could not start. Before the Commit
    # decision an aborted member is a refused Prepare, which aborts the attempt instead.
    checks = (
        (describe_failure, describe_launch_failure) if decision == COMMIT else (describe_failure,)
    )
    for failure in checks:
        for m in members:
            why = failure(m)
            if why is not None:
                return FAILED, why
    if any(m.state == M_UNKNOWN for m in members):
        return UNKNOWN, "a Node holding a member is disconnected"
    if decision is None:
        if all(m.state == M_RESERVED for m in members):
            return RESERVED, "the launch reservation owns every member's GPUs"
        prepared = sum(m.state == M_PREPARED for m in members)
        return PREPARING, (
            f"Prepare sent to every member's Node; {prepared} of {len(members)} prepared"
        )
    if all(m.state == M_EXITED for m in members):
        return SUCCEEDED, "every member exited with code 0"
    if all(m.state in (M_RUNNING, M_CANCELLING, M_EXITED) for m in members):
        return RUNNING, "every member is running"
    return STARTING, "the launch is committed; members are starting"


def next_job_state(current: str, derived: str) -> str:
    """Where a Job in ``current`` goes when its members say ``derived``; terminal is sticky.

    A queued Job leaves ``queued`` only for its new attempt's reservation: a retried Job's
    previous attempt may still report (a member stopping late), and that must not move it.
    """
    if current in TERMINAL_JOB_STATES or current == derived:
        return current
    if current == QUEUED and derived != RESERVED:
        return current
    check_job_move(current, derived)
    return derived


def may_follow(current: str, derived: str) -> bool:
    """Whether :func:`next_job_state` accepts ``derived`` after ``current`` (without raising)."""
    try:
        next_job_state(current, derived)
    except IllegalTransition:
        return False
    return True


class NotRetryable(IllegalTransition):
    """A retry of a Job that has not ended, or that succeeded."""


def check_retry(run_id: str, current: str) -> None:
    """Raise :class:`NotRetryable` (a sentence) unless a Job in ``current`` may be retried."""
    if current in RETRYABLE:
        return
    if current == SUCCEEDED:
        raise NotRetryable(
            f"the Job {run_id} succeeded; a retry is only for a Job that failed, was cancelled or "
            "was aborted. Submit the experiment again for another run."
        )
    raise NotRetryable(
        f"the Job {run_id} is {current} and has not ended; only a failed, cancelled or aborted "
        f"Job can be retried. Cancel it first with `tp job cancel {run_id}`, or wait for it."
    )
