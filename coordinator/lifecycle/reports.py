"""A Node's MemberReport (and its Hello's snapshot) judged before anything is written.

Rules:
- A report is applied only for a member placed on that Node, only one step of
  :data:`REPORT_MOVES` from its recorded state, only after Commit for the states that need it
  (:func:`judge_report`). A copy of an older report is *stale* (acknowledged, no change); a report
  two or more allowed steps ahead is *early* (not acknowledged, so the Node sends it again once the
  steps before it have arrived); anything else is *refused* with a sentence and changes nothing.
  Report numbers decide nothing, so a forged or restarted sequence can never hide a true report,
  and reordering only delays one.
- A member *declared lost* (its Node was declared lost, :mod:`~tuneplane.coordinator.node_loss`)
  has ended for good: every later report about it is refused with the declaration's sentence,
  so a Node that comes back can never move its Job again.
- A Hello is a snapshot, not a step (:func:`held_after_hello`).
"""

from __future__ import annotations

import posixpath

import attrs

from .states import (
    ABORT,
    COMMIT,
    M_ABORTED,
    M_CANCELLING,
    M_COMMITTED,
    M_EXITED,
    M_LOST,
    M_PREPARED,
    M_PREPARING,
    M_RESERVED,
    M_RUNNING,
    M_STARTING,
    MEMBER_RANK,
    TERMINAL_MEMBER_STATES,
)

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
