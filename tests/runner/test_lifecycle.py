"""The runner's sans-IO lifecycle: who gets stopped, when, and what the member's result is."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tuneplane.runner.lifecycle import (
    Finish,
    GraceExpired,
    IllegalTransition,
    Kill,
    MemberLifecycle,
    Phase,
    ProcessExited,
    StopRequested,
    Terminate,
)
from tuneplane.runner.records import ProcessResult


def test_all_processes_exiting_0_finish_with_0() -> None:
    lc = MemberLifecycle([0, 1])
    assert lc.handle(ProcessExited(1, 0, None)) == []
    (finish,) = lc.handle(ProcessExited(0, 0, None))
    assert finish == Finish(0, None, None, (ProcessResult(0, 0, None), ProcessResult(1, 0, None)))
    assert lc.phase is Phase.FINISHED


def test_first_failure_stops_the_siblings_and_is_the_result() -> None:
    lc = MemberLifecycle([0, 1, 2])
    assert lc.handle(ProcessExited(2, 5, None)) == [Terminate((0, 1))]
    assert lc.phase is Phase.STOPPING
    assert lc.handle(ProcessExited(0, None, 15)) == []
    assert lc.handle(GraceExpired()) == [Kill((1,))]
    (finish,) = lc.handle(ProcessExited(1, None, 9))
    assert isinstance(finish, Finish)
    assert (finish.exit_code, finish.signal) == (5, None)
    assert finish.stop_reason == "local rank 2 failed"


def test_a_stop_request_terminates_everyone_and_a_repeat_changes_nothing() -> None:
    lc = MemberLifecycle([0])
    assert lc.handle(StopRequested("runner received SIGTERM")) == [Terminate((0,))]
    assert lc.handle(StopRequested("runner received SIGINT")) == []
    (finish,) = lc.handle(ProcessExited(0, 0, None))
    assert isinstance(finish, Finish)
    # The workload handled SIGTERM and exited 0: that is its result, and the reason is kept.
    assert (finish.exit_code, finish.stop_reason) == (0, "runner received SIGTERM")


def test_illegal_moves_are_typed_errors() -> None:
    lc = MemberLifecycle([0])
    with pytest.raises(IllegalTransition, match="GraceExpired is not accepted while"):
        lc.handle(GraceExpired())
    with pytest.raises(IllegalTransition, match="local rank 7 exited but it is not running"):
        lc.handle(ProcessExited(7, 0, None))
    lc.handle(ProcessExited(0, 0, None))
    with pytest.raises(IllegalTransition, match="while the member is finished"):
        lc.handle(StopRequested("late"))


def test_a_member_needs_a_process() -> None:
    with pytest.raises(ValueError, match="at least one local process"):
        MemberLifecycle([])


outcomes = st.tuples(st.sampled_from([0, 0, 0, 1, 5, None]), st.sampled_from([None, 9, 15]))


@given(
    n=st.integers(min_value=1, max_value=6),
    data=st.data(),
)
def test_finish_comes_once_after_the_last_exit_with_the_first_failure(
    n: int, data: st.DataObject
) -> None:
    order = data.draw(st.permutations(list(range(n))))
    stop_at = data.draw(st.one_of(st.none(), st.integers(min_value=0, max_value=n - 1)))
    lc = MemberLifecycle(range(n))
    effects: list[object] = []
    first_failure: tuple[int | None, int | None] | None = None
    for i, rank in enumerate(order):
        if i == stop_at:
            effects += lc.handle(StopRequested("stop"))
        if lc.phase is Phase.STOPPING and data.draw(st.booleans()):
            effects += lc.handle(GraceExpired())
        code, sig = data.draw(outcomes)
        if sig is not None:
            code = None
        elif code is None:
            code = 0
        if first_failure is None and (code != 0 or sig is not None):
            first_failure = (code, sig)
        effects.append(("exited", rank))
        effects += lc.handle(ProcessExited(rank, code, sig))
    finishes = [e for e in effects if isinstance(e, Finish)]
    assert len(finishes) == 1
    assert effects[-1] is finishes[0]
    assert lc.phase is Phase.FINISHED
    assert (finishes[0].exit_code, finishes[0].signal) == (first_failure or (0, None))
    assert [p.local_rank for p in finishes[0].processes] == list(range(n))
    exited: set[int] = set()
    for effect in effects:
        if isinstance(effect, tuple):
            exited.add(effect[1])
        elif isinstance(effect, Terminate | Kill):
            # Exactly the processes still running are signalled, never one already reaped.
            assert set(effect.local_ranks) == set(range(n)) - exited
    assert sum(isinstance(e, Terminate) for e in effects) <= 1
