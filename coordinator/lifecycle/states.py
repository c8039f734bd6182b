"""The words of the Job and member lifecycles and their tables: which moves exist.

Rules:
- A Job moves only along :data:`JOB_TRANSITIONS`; anything else is :class:`IllegalTransition`.
  ``succeeded``, ``failed``, ``aborted`` and ``cancelled`` are terminal: what members report never
  changes them again. Only an explicit retry (:data:`RETRYABLE`) queues an ended Job once more,
  for a new attempt.
- A member moves forward only (:data:`MEMBER_RANK`): a late copy of an older report never undoes a
  newer one. ``unknown`` is not a rank: it overlays a member whose Node dropped, and the member's
  last known state is kept so the truth comes back when the Node reports again.
"""

from __future__ import annotations

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
    # Back to reserved: a Slurm job requeued after it started waits for its nodes again.
    STARTING: frozenset({RESERVED, RUNNING, SUCCEEDED, FAILED, UNKNOWN, CANCELLING, CANCELLED}),
    RUNNING: frozenset({RESERVED, SUCCEEDED, FAILED, UNKNOWN, CANCELLING, CANCELLED}),
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
