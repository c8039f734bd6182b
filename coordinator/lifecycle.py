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
  a lost connection never makes a Job ``failed``. A committed member its Node could not start
  (``aborted`` after Commit) fails the Job with the Node's sentence: nothing waits for it.
- A Node's report is judged before anything is written (:func:`judge_report`): only a member
  placed on that Node, only one step of :data:`REPORT_MOVES` from its recorded state, only after
  Commit for the states that need it. A copy of an older report is *stale* (acknowledged, no
  change); a report two or more allowed steps ahead is *early* (not acknowledged, so the Node
  sends it again once the steps before it have arrived); anything else is *refused* with a
  sentence and changes nothing. Report numbers decide nothing, so a forged or restarted
  sequence can never hide a true report, and reordering only delays one.
- A member *declared lost* (its Node was declared lost, :mod:`~tuneplane.coordinator.node_loss`)
  has ended for good: every later report about it is refused with the declaration's sentence,
  so a Node that comes back can never move its Job again.
"""

from __future__ import annotations

import posixpath
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


#: What a Node may report next about a member, from the member's recorded (known) state: one
#: step of the agent's member lifecycle (``agent/member_state.py``) seen through the states a Node
#: reports. ``reserved``/``preparing``/``prepared`` are the coordinator's own words (a Prepare
#: sent, a PrepareReply received); from them a Node can only have committed or given up. The
#: agent reports ``running`` before ``exited`` even for a workload that ended before it looked, so
#: a member that never ran cannot be reported finished.
REPORT_MOVES: dict[str, frozenset[str]] = {
    M_RESERVED: frozenset({M_ABORTED}),
    M_PREPARING: frozenset({M_ABORTED}),
    M_PREPARED: frozenset({M_COMMITTED, M_ABORTED}),
    M_COMMITTED: frozenset({M_STARTING, M_ABORTED}),
    M_STARTING: frozenset({M_RUNNING, M_CANCELLING, M_LOST, M_ABORTED}),
    M_RUNNING: frozenset({M_CANCELLING, M_EXITED, M_LOST}),
    M_CANCELLING: frozenset({M_EXITED, M_LOST}),
    M_EXITED: frozenset(),
    M_ABORTED: frozenset(),
    M_LOST: frozenset(),
}
#: The states a MemberReport may carry (the rest are the coordinator's own words).
REPORTABLE = frozenset(
    {M_COMMITTED, M_STARTING, M_RUNNING, M_CANCELLING, M_EXITED, M_ABORTED, M_LOST}
)
#: Reported states that exist only once the attempt's Commit decision is recorded.
NEEDS_COMMIT = REPORTABLE - {M_ABORTED}


@attrs.frozen
class ReportFacts:
    """What :func:`judge_report` needs: the report, and the member as the store records it."""

    node_id: str  # the Node whose credential sent the report
    member: str  # the member's name for sentences: ``<run id> attempt <n> member <i>``
    run_id: str
    attempt: int
    member_index: int
    reported: str
    has_exit: bool
    out_dir: str
    placed_on: str | None  # the Node the member is placed on; None when there is no such member
    known: str = M_RESERVED  # its last real state (never ``unknown``)
    decision: str | None = None  # its attempt's decision
    recorded_out_dir: str = ""
    declared_lost: str = ""  # the declaration's sentence when the member was declared lost


@attrs.frozen
class ApplyReport:
    """Record the member in ``state`` (with the report's exit and out dir)."""

    state: str


@attrs.frozen
class StaleReport:
    """The member is already at or past what the report says: acknowledge, change nothing."""


@attrs.frozen
class EarlyReport:
    """The report is more than one allowed step ahead of the recorded state (it overtook the
    reports before it): apply nothing and do not acknowledge it, so the Node sends it again."""


@attrs.frozen
class RefuseReport:
    """The Node could not have made this report: change nothing, answer ``reason``."""

    reason: str


ReportVerdict = ApplyReport | StaleReport | EarlyReport | RefuseReport


def _reachable(known: str) -> frozenset[str]:
    """Every state reachable from ``known`` along :data:`REPORT_MOVES` (``known`` excluded)."""
    seen: set[str] = set()
    todo = list(REPORT_MOVES[known])
    while todo:
        state = todo.pop()
        if state not in seen:
            seen.add(state)
            todo.extend(REPORT_MOVES[state])
    return frozenset(seen)


#: For each recorded state, the reported states that need more than one step to get there.
REPORT_LATER: dict[str, frozenset[str]] = {
    known: _reachable(known) - REPORT_MOVES[known] for known in REPORT_MOVES
}


def _out_dir_problem(facts: ReportFacts) -> str | None:
    """Why the report's out dir cannot be this member's, or None when it can be."""
    out = facts.out_dir
    if not out:
        return None
    parts = out.split("/")
    if (
        "\x00" in out
        or not out.startswith("/")
        or posixpath.normpath(out) != out
        or ".." in parts
        or not any(facts.run_id in part for part in parts)
    ):
        return (
            f"its out dir {out!r} is not an absolute, normalised path with the run id "
            f"{facts.run_id!r} in it, as every Node lays out $TUNEPLANE_OUT_DIR"
        )
    if facts.recorded_out_dir and out != facts.recorded_out_dir:
        return (
            f"its out dir {out!r} differs from the one already recorded "
            f"({facts.recorded_out_dir!r}); a member's out dir never moves"
        )
    return None


def judge_report(facts: ReportFacts) -> ReportVerdict:
    """Whether a Node's MemberReport is applied, stale, or refused (see the module rules).

    Pure: the caller reads the member and its attempt, asks here, then writes what it says.
    """

    def refuse(why: str) -> RefuseReport:
        return RefuseReport(
            f"Node {facts.node_id} reported {facts.member} as {facts.reported!r}, but {why}. "
            "The report was refused and changed nothing."
        )

    if facts.placed_on is None:
        return refuse("the coordinator holds no such member")
    if facts.placed_on != facts.node_id:
        return refuse("that member is not placed on this Node; a Node reports only its own members")
    if facts.reported not in REPORTABLE:
        return refuse(
            f"a MemberReport carries only {', '.join(sorted(REPORTABLE))}; "
            f"{facts.reported!r} is not one of them"
        )
    if facts.declared_lost:
        return refuse(
            f"the member was {facts.declared_lost.rstrip('.')}, and nothing its Node says about "
            "it changes its Job any more"
        )
    known = facts.known
    if known in TERMINAL_MEMBER_STATES or MEMBER_RANK[facts.reported] <= MEMBER_RANK[known]:
        return StaleReport()
    if facts.reported in NEEDS_COMMIT and facts.decision != COMMIT:
        return refuse(
            f"its attempt {'was aborted' if facts.decision == ABORT else 'is not committed'}, "
            "so nothing of it can have started"
        )
    if facts.reported in REPORT_LATER[known]:
        return EarlyReport()
    if facts.reported not in REPORT_MOVES[known]:
        allowed = ", ".join(sorted(REPORT_MOVES[known])) or "nothing (it has ended)"
        return refuse(f"the member is {known} and can only move to {allowed} from there")
    if facts.reported == M_EXITED and not facts.has_exit:
        return refuse("an exited member's report must carry its exit code or signal")
    problem = _out_dir_problem(facts)
    if problem is not None:
        return refuse(problem)
    return ApplyReport(facts.reported)


def held_after_hello(known: str, held: str, decision: str | None) -> str | None:
    """The member's new recorded state when its Node's Hello says it holds it in ``held``, or
    None to keep ``known``.

    A Hello is a snapshot, not a step: the Node may have moved on several steps while it was
    away, so any state reachable from ``known`` is taken, but never a started state before
    Commit, never a state that is not reachable (backwards, or off the lifecycle), and never an
    end (ends come as reports, with their exit).
    """
    if held == M_PREPARED:
        return held if MEMBER_RANK[known] < MEMBER_RANK[M_PREPARED] else None
    if held not in REPORTABLE or held in TERMINAL_MEMBER_STATES:
        return None
    if held in NEEDS_COMMIT and decision != COMMIT:
        return None
    if known not in REPORT_MOVES or held not in REPORT_MOVES[known] | REPORT_LATER[known]:
        return None
    return held


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
