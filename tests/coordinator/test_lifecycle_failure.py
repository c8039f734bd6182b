"""Which member of a failed Job failed first: the pure choice and the stderr tail."""

from __future__ import annotations

import attrs

from tuneplane.coordinator import lifecycle as lc
from tuneplane.coordinator.lifecycle_failure import (
    TAIL_BYTES,
    TAIL_LINES,
    Failed,
    MemberEnd,
    choose_first,
    culprit,
    first_failure,
    member_end,
    tail_lines,
)
from tuneplane.coordinator.values.jobs import Attempt, Job, Member, MemberKey, StateChange


def _exited(index: int, at_ms: int, code: int = 0, signal: int = 0) -> MemberEnd:
    return MemberEnd(index, lc.M_EXITED, True, code, signal, ended_at_ms=at_ms)


def test_the_earliest_reported_end_is_first_whatever_the_index() -> None:
    members = [_exited(0, 2_000, signal=15), _exited(1, 1_000, code=3), _exited(2, 1_500, code=1)]
    assert choose_first(members) == Failed(1, 1_000, "member 1 exited with code 3")


def test_a_zero_exit_and_a_live_member_never_count() -> None:
    members = [_exited(0, 100), MemberEnd(1, lc.M_RUNNING), _exited(2, 900, code=2)]
    assert choose_first(members) == Failed(2, 900, "member 2 exited with code 2")
    assert choose_first([_exited(0, 100), MemberEnd(1, lc.M_RUNNING)]) is None
    assert choose_first([]) is None


def test_a_tie_goes_to_an_exit_code_then_a_signal_then_the_lowest_index() -> None:
    by_signal, by_code = _exited(0, 5_000, signal=9), _exited(1, 5_000, code=3)
    assert choose_first([by_signal, by_code]).index == 1  # type: ignore[union-attr]
    a, b = _exited(3, 5_000, code=1), _exited(2, 5_000, code=7)
    assert choose_first([a, b]) == Failed(2, 5_000, "member 2 exited with code 7")
    lost = MemberEnd(0, lc.M_LOST, silent_since_ms=5_000)
    assert choose_first([lost, by_signal]) == Failed(0, 5_000, "member 0 was ended by signal 9")


def test_a_member_killed_by_a_signal_first_is_the_cause() -> None:
    oom, sibling = _exited(1, 1_000, signal=9), _exited(0, 1_400, code=1)
    assert choose_first([sibling, oom]) == Failed(1, 1_000, "member 1 was ended by signal 9")


def test_a_lost_member_counts_from_when_its_node_went_silent() -> None:
    # Its Node went silent at 1 000; the sibling that waited on it timed out at 60 000.
    lost = MemberEnd(1, lc.M_LOST, reason="declared lost", silent_since_ms=1_000)
    timed_out = _exited(0, 60_000, code=1)
    assert choose_first([timed_out, lost]) == Failed(1, 1_000, "member 1 was lost by its Node")


def test_a_failure_with_no_known_time_comes_after_every_timed_one() -> None:
    untimed = MemberEnd(0, lc.M_LOST)
    timed = _exited(1, 9_999_999, code=4)
    assert choose_first([untimed, timed]).index == 1  # type: ignore[union-attr]
    assert choose_first([untimed]) == Failed(0, 0, "member 0 was lost by its Node")


def test_a_launch_failure_is_a_failure_with_its_nodes_sentence() -> None:
    aborted = MemberEnd(1, lc.M_ABORTED, reason="python3: no such file", ended_at_ms=10)
    assert choose_first([MemberEnd(0, lc.M_RUNNING), aborted]) == Failed(
        1, 10, "member 1 could not be started on its Node: python3: no such file"
    )


def _view(state: str, history: list[tuple[str, int]], ended: int = 0) -> Member:
    changes = tuple(StateChange(s, at, f"why {s}") for s, at in history)
    return Member(0, "node-a", state, False, 0, 0, "", (), changes, ended)


def test_a_stored_member_is_silent_since_its_trailing_unknown_run() -> None:
    view = _view(
        lc.M_LOST,
        [(lc.M_RUNNING, 10), (lc.M_UNKNOWN, 20), (lc.M_RUNNING, 30), (lc.M_UNKNOWN, 40),
         (lc.M_LOST, 90)],
    )  # fmt: skip
    end = member_end(view)
    assert end.silent_since_ms == 40 and end.reason == "why lost" and end.ended_at_ms == 0
    assert member_end(_view(lc.M_EXITED, [(lc.M_EXITED, 50)], ended=45)).ended_at_ms == 45
    assert member_end(_view(lc.M_EXITED, [(lc.M_EXITED, 50)])).silent_since_ms == 0


def test_the_tail_keeps_the_last_lines_within_the_bounds() -> None:
    data = b"".join(f"line {i}\n".encode() for i in range(100))
    text, cut = tail_lines(data, started_at_zero=True)
    assert cut and text.splitlines() == [f"line {i}" for i in range(100 - TAIL_LINES, 100)]
    assert tail_lines(b"a\nb\n", started_at_zero=True) == ("a\nb\n", False)
    assert tail_lines(b"", started_at_zero=True) == ("", False)


def test_the_tail_drops_a_cut_first_line_and_bounds_long_lines() -> None:
    assert tail_lines(b"end of a long line\nwhole\n", started_at_zero=False) == ("whole\n", True)
    huge = b"x" * (3 * TAIL_BYTES) + b"\nlast\n"
    text, cut = tail_lines(huge, started_at_zero=True)
    assert cut and text == "last\n"
    assert tail_lines(b"caf\xc3\xa9 \xff\n", started_at_zero=True)[0] == "caf\u00e9 \ufffd\n"


def _failed_job(state: str = lc.FAILED) -> Job:
    ok = Member(0, "node-a", lc.M_EXITED, True, 0, 0, "", (), (), ended_at_ms=3_000)
    bad = Member(1, "node-b", lc.M_EXITED, True, 7, 0, "", (), (), ended_at_ms=2_000)
    attempt = Attempt(2, "ended", (ok, bad), "", 0, 0)
    return Job("run-1", "p", "e", "ann", state, "default", "h200", "m", "pv", "d", "", 0,
               attempts=(attempt,))  # fmt: skip


def test_the_culprit_is_the_latest_attempts_first_failed_member() -> None:
    found = culprit(_failed_job())
    assert found is not None
    assert found.key == MemberKey("run-1", 2, 1)
    assert found.failed == Failed(1, 2_000, "member 1 exited with code 7")
    assert culprit(_failed_job(lc.SUCCEEDED)) is None
    assert culprit(attrs.evolve(_failed_job(), attempts=())) is None


def test_the_first_failure_carries_the_end_of_the_stderr_read_for_the_culprit() -> None:
    found = culprit(_failed_job())
    assert found is not None
    shown = first_failure(found, b"cut line\nfirst\nsecond\n", from_start=False)
    assert (shown.attempt, shown.member_index, shown.node_id) == (2, 1, "node-b")
    assert (shown.exit_code, shown.at_ms, shown.what) == (7, 2_000, "member 1 exited with code 7")
    assert (shown.stderr_tail, shown.stderr_cut) == ("first\nsecond\n", True)
    nothing = first_failure(found, b"", from_start=True)
    assert (nothing.stderr_tail, nothing.stderr_cut) == ("", False)
