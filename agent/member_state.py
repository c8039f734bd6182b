"""The member lifecycle as data: ``state -> event -> new state``.

Rules: the table below is the whole lifecycle; a pair missing from it is an illegal move and
raises :class:`IllegalTransition`. Terminal states (exited, aborted, lost) have no moves out.
Nothing here does I/O: the journal asks :func:`next_state` before it writes a transition.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping


class MemberState(enum.Enum):
    """Where one member is. The values are what the journal stores and ``journal`` prints."""

    PREPARING = "preparing"
    PREPARED = "prepared"
    COMMITTED = "committed"
    STARTING = "starting"
    RUNNING = "running"
    EXITED = "exited"
    ABORTED = "aborted"
    CANCELLING = "cancelling"
    LOST = "lost"


class MemberEvent(enum.Enum):
    """What can happen to a member."""

    # The checks passed and the capsule is materialised; the GPUs are owned.
    PREPARE_SUCCEEDED = "prepare-succeeded"
    # A check failed (GPUs busy, digest mismatch, bad JobSpec, agent restarted mid-prepare).
    PREPARE_FAILED = "prepare-failed"
    COMMIT_RECEIVED = "commit-received"
    ABORT_RECEIVED = "abort-received"
    CANCEL_RECEIVED = "cancel-received"
    # The launch file is written and the runner is being started.
    SPAWN_REQUESTED = "spawn-requested"
    # The member could not be launched (no plan, the runner refused); nothing of it started.
    LAUNCH_FAILED = "launch-failed"
    # supervision observed the runner alive (pid and start time).
    RUNNER_STARTED = "runner-started"
    # supervision read the runner's durable exit record.
    EXIT_OBSERVED = "exit-observed"
    # The runner is gone without an exit record.
    RUNNER_VANISHED = "runner-vanished"


S = MemberState
E = MemberEvent

#: Every legal move. Read a row as "in <state>, on <event>, go to <state>".
TRANSITIONS: Mapping[MemberState, Mapping[MemberEvent, MemberState]] = {
    S.PREPARING: {
        E.PREPARE_SUCCEEDED: S.PREPARED,
        E.PREPARE_FAILED: S.ABORTED,
        E.ABORT_RECEIVED: S.ABORTED,
    },
    S.PREPARED: {
        E.COMMIT_RECEIVED: S.COMMITTED,
        E.ABORT_RECEIVED: S.ABORTED,
        # Cancelled before anything started: nothing to stop, the GPUs go back.
        E.CANCEL_RECEIVED: S.ABORTED,
    },
    S.COMMITTED: {
        E.SPAWN_REQUESTED: S.STARTING,
        E.LAUNCH_FAILED: S.ABORTED,
        E.CANCEL_RECEIVED: S.ABORTED,
    },
    S.STARTING: {
        E.RUNNER_STARTED: S.RUNNING,
        # A workload that ends before the agent saw it running still has an exit record.
        E.EXIT_OBSERVED: S.EXITED,
        E.RUNNER_VANISHED: S.LOST,
        E.LAUNCH_FAILED: S.ABORTED,
        E.CANCEL_RECEIVED: S.CANCELLING,
    },
    S.RUNNING: {
        E.EXIT_OBSERVED: S.EXITED,
        E.RUNNER_VANISHED: S.LOST,
        E.CANCEL_RECEIVED: S.CANCELLING,
    },
    S.CANCELLING: {
        # The runner may report itself alive after the cancel was journaled.
        E.RUNNER_STARTED: S.CANCELLING,
        E.EXIT_OBSERVED: S.EXITED,
        E.RUNNER_VANISHED: S.LOST,
    },
    S.EXITED: {},
    S.ABORTED: {},
    S.LOST: {},
}

TERMINAL: frozenset[MemberState] = frozenset(s for s, moves in TRANSITIONS.items() if not moves)

#: States of members that have not ended: the ones whose pool accounts are held, and whose
#: runtime image the cache must keep.
LIVE_STATES: frozenset[MemberState] = frozenset(MemberState) - TERMINAL

#: States in which the member owns its GPUs (from prepared until it ends).
OWNS_GPUS: frozenset[MemberState] = frozenset(
    {S.PREPARED, S.COMMITTED, S.STARTING, S.RUNNING, S.CANCELLING}
)

#: States past the commit decision: the member was (or may have been) started.
COMMITTED_OR_LATER: frozenset[MemberState] = frozenset(
    {S.COMMITTED, S.STARTING, S.RUNNING, S.CANCELLING, S.EXITED, S.LOST}
)


class IllegalTransition(Exception):
    """A move the lifecycle table does not allow. The journal refuses to write it."""

    def __init__(self, state: MemberState, event: MemberEvent) -> None:
        self.state = state
        self.event = event
        allowed = ", ".join(sorted(e.value for e in TRANSITIONS[state])) or "none (terminal)"
        super().__init__(
            f"A member in state '{state.value}' cannot take event '{event.value}'; "
            f"allowed events there: {allowed}."
        )


def next_state(state: MemberState, event: MemberEvent) -> MemberState:
    """The state after ``event`` in ``state``; raises :class:`IllegalTransition` if none."""
    try:
        return TRANSITIONS[state][event]
    except KeyError:
        raise IllegalTransition(state, event) from None


def is_terminal(state: MemberState) -> bool:
    return state in TERMINAL
