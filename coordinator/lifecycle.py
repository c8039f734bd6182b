"""Job and member lifecycles as the coordinator records them: tables, not branches.

Rules:
- A Job moves only along :data:`JOB_TRANSITIONS`; anything else is :class:`IllegalTransition`.
  ``succeeded``, ``failed``, ``aborted`` and ``cancelled`` are terminal: what members report never
  changes them again. Only an explicit retry (:data:`RETRYABLE`) queues an ended Job once more,
  for a new attempt; while it waits, news of its previous attempt never moves it.
- A member moves forward only (:data:`MEMBER_RANK`): a late copy of an older report never undoes a
  newer one. ``unknown`` is not a rank: it overlays a member whose Node dropped, and the member's
  last known state is kept so the truth comes back when the Node reports again.
- The Job's state is *derived* from its attempt's decision and members (:func:`derive_job_state`);
  a lost connection never makes a Job ``failed``.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

# Job states.
QUEUED = "queued"
RESERVED = "reserved"
PREPARING = "preparing"
STARTING = "starting"
RUNNING = "running"
SUCCEEDED = "succeeded"
FAILED = "failed"
ABORTED = "aborted"
UNKNOWN = "unknown"
CANCELLING = "cancelling"
CANCELLED = "cancelled"

TERMINAL_JOB_STATES = frozenset({SUCCEEDED, FAILED, ABORTED, CANCELLED})
#: Ended Jobs a person may retry (a succeeded Job is done; submit it again instead).
RETRYABLE = frozenset({FAILED, CANCELLED, ABORTED})

JOB_TRANSITIONS: dict[str, frozenset[str]] = {
    QUEUED: frozenset({RESERVED, CANCELLED}),
    RESERVED: frozenset(
        {PREPARING, STARTING, RUNNING, SUCCEEDED, FAILED, ABORTED, UNKNOWN, CANCELLING, CANCELLED}
    ),
    PREPARING: frozenset(
        {STARTING, RUNNING, SUCCEEDED, FAILED, ABORTED, UNKNOWN, CANCELLING, CANCELLED}
    ),
    STARTING: frozenset({RUNNING, SUCCEEDED, FAILED, UNKNOWN, CANCELLING, CANCELLED}),
    RUNNING: frozenset({SUCCEEDED, FAILED, UNKNOWN, CANCELLING, CANCELLED}),
    UNKNOWN: frozenset(
        {
            RESERVED,
            PREPARING,
            STARTING,
            RUNNING,
            SUCCEEDED,
            FAILED,
            ABORTED,
            CANCELLING,
            CANCELLED,
        }
    ),
    # Once cancelled, what the members do next (exit by SIGTERM, exit 0 in the grace period) is
    # the cancel's doing, never a failure or a success.
    CANCELLING: frozenset({CANCELLED}),
    SUCCEEDED: frozenset(),
    FAILED: frozenset({QUEUED}),
    ABORTED: frozenset({QUEUED}),
    CANCELLED: frozenset({QUEUED}),
}

# Member states (the coordinator's view; the Node reports the same words).
M_RESERVED = "reserved"
M_PREPARING = "preparing"
M_PREPARED = "prepared"
M_COMMITTED = "committed"
M_STARTING = "starting"
M_RUNNING = "running"
M_CANCELLING = "cancelling"
M_EXITED = "exited"
M_ABORTED = "aborted"
M_LOST = "lost"
M_UNKNOWN = "unknown"

MEMBER_RANK: dict[str, int] = {
    M_RESERVED: 0,
    M_PREPARING: 1,
    M_PREPARED: 2,
    M_COMMITTED: 3,
    M_STARTING: 4,
    M_RUNNING: 5,
    M_CANCELLING: 6,
    M_EXITED: 7,
    M_ABORTED: 7,
    M_LOST: 7,
}
TERMINAL_MEMBER_STATES = frozenset({M_EXITED, M_ABORTED, M_LOST})

# Attempt decisions.
COMMIT = "commit"
ABORT = "abort"


class IllegalTransition(ValueError):
    """A state change the lifecycle tables do not allow."""


def check_job_move(old: str, new: str) -> None:
    """Raise :class:`IllegalTransition` unless ``old -> new`` is in :data:`JOB_TRANSITIONS`."""
    if old == new:
        return
    if new not in JOB_TRANSITIONS.get(old, frozenset()):
        raise IllegalTransition(f"a Job cannot move from {old} to {new}")


def member_after_report(known: str, reported: str) -> str | None:
    """The member's new known state after a report, or None when the report is stale.

    ``known`` is the last real state (never ``unknown``). Terminal states are sticky.
    """
    if reported not in MEMBER_RANK:
        raise IllegalTransition(f"a member cannot be reported as {reported!r}")
    if known in TERMINAL_MEMBER_STATES:
        return None
    if MEMBER_RANK[reported] < MEMBER_RANK[known]:
        return None
    if reported == known:
        return None
    return reported


@attrs.frozen
class MemberFacts:
    """What :func:`derive_job_state` needs to know about one member."""

    index: int
    state: str  # the visible state: ``unknown`` while its Node is disconnected
    has_exit: bool = False
    exit_code: int = 0
    signal: int = 0


def _failure(m: MemberFacts) -> str | None:
    if m.state == M_LOST:
        return f"member {m.index} was lost by its Node"
    if m.state == M_EXITED and m.has_exit and (m.exit_code != 0 or m.signal != 0):
        if m.signal:
            return f"member {m.index} was ended by signal {m.signal}"
        return f"member {m.index} exited with code {m.exit_code}"
    return None


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
    for m in members:
        why = _failure(m)
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
