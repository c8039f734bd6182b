"""Which MemberReports the coordinator applies: :func:`lifecycle.judge_report`, pure.

Two sides are tested. Exhaustively, every (recorded state, reported state, decision, placement)
gets the verdict the rules name. And with Hypothesis, an honest agent (its real lifecycle table,
driven the way the member manager drives it) never has a report refused, whatever the order
its reports arrive in and however often they repeat, and the coordinator ends where it ends.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tuneplane.agent.journal_records import MemberKey
from tuneplane.agent.member_state import TRANSITIONS, MemberEvent, MemberState
from tuneplane.agent.members_base import out_dir_for
from tuneplane.coordinator import lifecycle as lc

NODE = "node-a"
RUN = "r-7f3a"
OUT = str(out_dir_for(Path("/srv/tuneplane/out"), MemberKey(RUN, 1, 0)))
ALL_STATES = [*sorted(lc.MEMBER_RANK), lc.M_UNKNOWN]


def facts(
    known: str,
    reported: str,
    decision: str | None = lc.COMMIT,
    placed_on: str | None = NODE,
    has_exit: bool = True,
    out_dir: str = OUT,
    recorded_out_dir: str = "",
) -> lc.ReportFacts:
    return lc.ReportFacts(
        node_id=NODE,
        member=f"{RUN} attempt 1 member 0",
        run_id=RUN,
        attempt=1,
        member_index=0,
        reported=reported,
        has_exit=has_exit,
        out_dir=out_dir,
        placed_on=placed_on,
        known=known,
        decision=decision,
        recorded_out_dir=recorded_out_dir,
    )


def expected(known: str, reported: str, decision: str | None) -> type[lc.ReportVerdict]:
    """The rules of docs/security.md, written out once more, independently."""
    if reported not in lc.REPORTABLE:
        return lc.RefuseReport
    if known in lc.TERMINAL_MEMBER_STATES or lc.MEMBER_RANK[reported] <= lc.MEMBER_RANK[known]:
        return lc.StaleReport
    if reported != lc.M_ABORTED and decision != lc.COMMIT:
        return lc.RefuseReport
    if reported in lc.REPORT_MOVES[known]:
        return lc.ApplyReport
    if reported in lc.REPORT_LATER[known]:
        return lc.EarlyReport
    return lc.RefuseReport


@pytest.mark.parametrize("decision", [None, lc.COMMIT, lc.ABORT])
def test_every_recorded_and_reported_state_gets_the_verdict_of_the_rules(
    decision: str | None,
) -> None:
    for known, reported in itertools.product(lc.MEMBER_RANK, ALL_STATES):
        verdict = lc.judge_report(facts(known, reported, decision))
        assert type(verdict) is expected(known, reported, decision), (known, reported, verdict)
        if isinstance(verdict, lc.ApplyReport):
            assert verdict.state == reported
        if isinstance(verdict, lc.RefuseReport):
            assert verdict.reason.endswith("The report was refused and changed nothing.")
            assert NODE in verdict.reason and RUN in verdict.reason


@pytest.mark.parametrize("known", sorted(lc.MEMBER_RANK))
@pytest.mark.parametrize("reported", ALL_STATES)
def test_a_report_about_another_nodes_member_or_none_is_refused(known: str, reported: str) -> None:
    other = lc.judge_report(facts(known, reported, placed_on="node-b"))
    assert isinstance(other, lc.RefuseReport)
    assert "not placed on this Node" in other.reason
    # The sentence never names the Node that holds the member.
    assert "node-b" not in other.reason
    missing = lc.judge_report(facts(known, reported, placed_on=None))
    assert isinstance(missing, lc.RefuseReport)
    assert "holds no such member" in missing.reason


def test_a_member_that_never_ran_cannot_be_reported_finished() -> None:
    for known in (lc.M_PREPARED, lc.M_COMMITTED, lc.M_STARTING):
        verdict = lc.judge_report(facts(known, lc.M_EXITED))
        assert not isinstance(verdict, (lc.ApplyReport, lc.StaleReport)), known
    # Before Commit nothing can have started: refused outright.
    for known in (lc.M_RESERVED, lc.M_PREPARING, lc.M_PREPARED):
        refused = lc.judge_report(facts(known, lc.M_EXITED, decision=None))
        assert isinstance(refused, lc.RefuseReport)
        assert "not committed" in refused.reason


def test_an_exit_without_its_code_is_refused() -> None:
    verdict = lc.judge_report(facts(lc.M_RUNNING, lc.M_EXITED, has_exit=False))
    assert isinstance(verdict, lc.RefuseReport)
    assert "exit code or signal" in verdict.reason


@pytest.mark.parametrize(
    "out_dir",
    [
        "/etc",
        "etc/" + RUN,
        f"/srv/out/{RUN}/../../etc",
        f"/srv/out/{RUN}/./attempt-1",
        f"/srv/out//{RUN}",
        f"/srv/out/{RUN}\x00/x",
        "/srv/out/another-run/attempt-1/member-0",
    ],
)
def test_an_out_dir_that_cannot_be_the_members_is_refused(out_dir: str) -> None:
    verdict = lc.judge_report(facts(lc.M_RUNNING, lc.M_EXITED, out_dir=out_dir))
    assert isinstance(verdict, lc.RefuseReport)
    assert "out dir" in verdict.reason


def test_an_out_dir_never_moves_once_recorded() -> None:
    moved = lc.judge_report(
        facts(lc.M_RUNNING, lc.M_EXITED, out_dir=f"/tmp/{RUN}", recorded_out_dir=OUT)
    )
    assert isinstance(moved, lc.RefuseReport)
    same = lc.judge_report(facts(lc.M_RUNNING, lc.M_EXITED, recorded_out_dir=OUT))
    assert same == lc.ApplyReport(lc.M_EXITED)
    assert lc.judge_report(facts(lc.M_RUNNING, lc.M_EXITED, out_dir="")) == lc.ApplyReport(
        lc.M_EXITED
    )


# ----- an honest agent, as the member manager drives its lifecycle ------------------------------

E = MemberEvent
S = MemberState
REPORTED = {S.COMMITTED, S.STARTING, S.RUNNING, S.CANCELLING, S.EXITED, S.ABORTED, S.LOST}


@attrs.define
class Coordinator:
    """What the store records about the member, and what it decides, in this model."""

    known: str = lc.M_PREPARING
    decision: str | None = None


def honest_run(choices: list[int]) -> tuple[list[tuple[str, bool]], Coordinator]:
    """Walk the agent's table from ``preparing``; return its reports and the coordinator's
    decisions taken along the way (Commit before COMMIT_RECEIVED, Abort before ABORT_RECEIVED).

    As :meth:`MemberManager.apply` does, an exit seen while ``starting`` is journaled as
    running first, then exited.
    """
    state, coord, reports = S.PREPARING, Coordinator(), []
    for choice in choices:
        moves = sorted(TRANSITIONS[state].items(), key=lambda kv: kv[0].value)
        if not moves:
            break
        event, after = moves[choice % len(moves)]
        if event is E.COMMIT_RECEIVED:
            coord.decision = lc.COMMIT
        if event is E.ABORT_RECEIVED or (
            # A refused Prepare, or a cancel before Commit: the coordinator aborts the attempt.
            event is E.PREPARE_FAILED or (event is E.CANCEL_RECEIVED and state is S.PREPARED)
        ):
            coord.decision, coord.known = lc.ABORT, lc.M_ABORTED
        if state is S.STARTING and event is E.EXIT_OBSERVED:
            reports.append((S.RUNNING.value, False))
        if after is S.PREPARED:
            coord.known = lc.M_PREPARED  # the PrepareReply
        state = after
        if state in REPORTED:
            reports.append((state.value, state is S.EXITED))
    return reports, coord


def deliver(coord: Coordinator, arrivals: list[tuple[str, bool]]) -> list[lc.ReportVerdict]:
    """Feed reports to the judge; an early one comes back later, as the Node resends it."""
    verdicts: list[lc.ReportVerdict] = []
    queue = list(arrivals)
    for _ in range(10 * len(queue) + 10):
        if not queue:
            break
        state, has_exit = queue.pop(0)
        verdict = lc.judge_report(
            facts(coord.known, state, coord.decision, has_exit=has_exit, recorded_out_dir=OUT)
        )
        verdicts.append(verdict)
        if isinstance(verdict, lc.ApplyReport):
            coord.known = verdict.state
        elif isinstance(verdict, lc.EarlyReport):
            queue.append((state, has_exit))
    assert not queue, f"reports never applied: {queue}"
    return verdicts


@settings(max_examples=300, deadline=None)
@given(
    choices=st.lists(st.integers(0, 5), max_size=12),
    swaps=st.lists(st.integers(0, 20), max_size=6),
    repeats=st.lists(st.integers(0, 20), max_size=6),
)
def test_an_honest_agent_is_never_refused_in_any_order(
    choices: list[int], swaps: list[int], repeats: list[int]
) -> None:
    reports, coord = honest_run(choices)
    arrivals = list(reports)
    for i in repeats:  # a resend after a lost ack, or a replay after reconnecting
        if arrivals:
            arrivals.append(arrivals[i % len(arrivals)])
    for i in swaps:  # a newer report overtaking an older one
        if len(arrivals) > 1:
            j = i % (len(arrivals) - 1)
            arrivals[j], arrivals[j + 1] = arrivals[j + 1], arrivals[j]
    verdicts = deliver(coord, arrivals)
    assert not [v for v in verdicts if isinstance(v, lc.RefuseReport)], verdicts
    if reports and coord.known != lc.M_ABORTED:
        assert coord.known == reports[-1][0]


@settings(max_examples=200, deadline=None)
@given(
    known=st.sampled_from(sorted(lc.MEMBER_RANK)),
    reported=st.sampled_from(ALL_STATES),
    decision=st.sampled_from([None, lc.COMMIT, lc.ABORT]),
    placed_on=st.sampled_from([None, NODE, "node-b"]),
    has_exit=st.booleans(),
    out_dir=st.sampled_from(["", OUT, "/etc", f"/x/{RUN}/../y"]),
)
def test_whatever_a_thief_sends_nothing_moves_backwards_or_off_its_own_node(
    known: str,
    reported: str,
    decision: str | None,
    placed_on: str | None,
    has_exit: bool,
    out_dir: str,
) -> None:
    verdict = lc.judge_report(facts(known, reported, decision, placed_on, has_exit, out_dir))
    if isinstance(verdict, lc.ApplyReport):
        assert placed_on == NODE
        assert verdict.state in lc.REPORT_MOVES[known]
        assert lc.MEMBER_RANK[verdict.state] > lc.MEMBER_RANK[known]
        assert verdict.state == lc.M_ABORTED or decision == lc.COMMIT
        assert out_dir in ("", OUT)
        assert verdict.state != lc.M_EXITED or has_exit


def test_a_committed_member_its_node_could_not_start_fails_the_job_with_the_nodes_sentence() -> (
    None
):
    why = "The member's out dir cannot be made: [Errno 20] Not a directory: '/srv/out/r'."
    aborted = lc.MemberFacts(0, lc.M_ABORTED, reason=why)
    running = lc.MemberFacts(1, lc.M_RUNNING)
    state, reason = lc.derive_job_state(lc.COMMIT, "", [aborted, running])
    assert state == lc.FAILED
    assert reason.startswith("member 0 could not be started on its Node: The member's out dir")
    # A real exit explains more than a sibling stopped because of it.
    bad = lc.MemberFacts(1, lc.M_EXITED, has_exit=True, exit_code=3)
    assert lc.derive_job_state(lc.COMMIT, "", [aborted, bad]) == (
        lc.FAILED,
        "member 1 exited with code 3",
    )
    # Before Commit an aborted member is a refused Prepare: that aborts, it does not fail.
    assert lc.derive_job_state(None, "", [aborted, running])[0] != lc.FAILED
    assert lc.next_job_state(lc.STARTING, lc.FAILED) == lc.FAILED


def test_a_hello_moves_a_member_only_forward_along_its_lifecycle() -> None:
    hello = lc.held_after_hello
    assert hello(lc.M_COMMITTED, lc.M_RUNNING, lc.COMMIT) == lc.M_RUNNING  # moved on while away
    assert hello(lc.M_PREPARING, lc.M_PREPARED, None) == lc.M_PREPARED
    assert hello(lc.M_PREPARING, lc.M_RUNNING, None) is None  # nothing starts before Commit
    assert hello(lc.M_RUNNING, lc.M_STARTING, lc.COMMIT) is None  # never backwards
    assert hello(lc.M_RUNNING, lc.M_EXITED, lc.COMMIT) is None  # ends come as reports
    assert hello(lc.M_COMMITTED, lc.M_PREPARED, lc.COMMIT) is None
    assert hello(lc.M_RUNNING, "bogus", lc.COMMIT) is None
    for known, held, decision in itertools.product(
        lc.MEMBER_RANK, ALL_STATES, (None, lc.COMMIT, lc.ABORT)
    ):
        moved = hello(known, held, decision)
        if moved is not None:
            assert lc.MEMBER_RANK[moved] > lc.MEMBER_RANK[known]
            assert moved not in lc.TERMINAL_MEMBER_STATES
            assert moved not in lc.NEEDS_COMMIT or decision == lc.COMMIT
