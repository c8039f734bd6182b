"""The member lifecycle table, checked pair by pair and against a plain model."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tuneplane.agent.member_state import (
    OWNS_GPUS,
    TERMINAL,
    IllegalTransition,
    MemberEvent,
    MemberState,
    is_terminal,
    next_state,
)

S = MemberState
E = MemberEvent

# The lifecycle written out longhand, independently of the table, as the reference.
EXPECTED = {
    (S.PREPARING, E.PREPARE_SUCCEEDED): S.PREPARED,
    (S.PREPARING, E.PREPARE_FAILED): S.ABORTED,
    (S.PREPARING, E.ABORT_RECEIVED): S.ABORTED,
    (S.PREPARED, E.COMMIT_RECEIVED): S.COMMITTED,
    (S.PREPARED, E.ABORT_RECEIVED): S.ABORTED,
    (S.PREPARED, E.CANCEL_RECEIVED): S.ABORTED,
    (S.COMMITTED, E.SPAWN_REQUESTED): S.STARTING,
    (S.COMMITTED, E.CANCEL_RECEIVED): S.ABORTED,
    (S.COMMITTED, E.LAUNCH_FAILED): S.ABORTED,
    (S.STARTING, E.LAUNCH_FAILED): S.ABORTED,
    (S.STARTING, E.RUNNER_STARTED): S.RUNNING,
    (S.STARTING, E.EXIT_OBSERVED): S.EXITED,
    (S.STARTING, E.RUNNER_VANISHED): S.LOST,
    (S.STARTING, E.CANCEL_RECEIVED): S.CANCELLING,
    (S.RUNNING, E.EXIT_OBSERVED): S.EXITED,
    (S.RUNNING, E.RUNNER_VANISHED): S.LOST,
    (S.RUNNING, E.CANCEL_RECEIVED): S.CANCELLING,
    (S.CANCELLING, E.RUNNER_STARTED): S.CANCELLING,
    (S.CANCELLING, E.EXIT_OBSERVED): S.EXITED,
    (S.CANCELLING, E.RUNNER_VANISHED): S.LOST,
}


@pytest.mark.parametrize(("state", "event"), list(itertools.product(S, E)))
def test_every_pair(state: MemberState, event: MemberEvent) -> None:
    if (state, event) in EXPECTED:
        assert next_state(state, event) is EXPECTED[(state, event)]
    else:
        with pytest.raises(IllegalTransition) as info:
            next_state(state, event)
        assert info.value.state is state
        assert info.value.event is event
        assert state.value in str(info.value) and event.value in str(info.value)


def test_terminal_states_have_no_way_out() -> None:
    assert {S.EXITED, S.ABORTED, S.LOST} == TERMINAL
    for state in S:
        assert is_terminal(state) == (state in TERMINAL)


def test_terminal_states_own_no_gpus() -> None:
    assert not (TERMINAL & OWNS_GPUS)
    assert S.PREPARING not in OWNS_GPUS


class Lifecycle(RuleBasedStateMachine):
    """Random event sequences: the table and a hand-written model must agree at every step."""

    def __init__(self) -> None:
        super().__init__()
        self.state = S.PREPARING
        self.model = "preparing"
        self.started = False

    def _model_step(self, event: MemberEvent) -> str | None:
        m, name = self.model, event.value
        if m == "preparing":
            return {"prepare-succeeded": "prepared"}.get(name) or (
                "aborted" if name in ("prepare-failed", "abort-received") else None
            )
        if m == "prepared":
            if name == "commit-received":
                return "committed"
            return "aborted" if name in ("abort-received", "cancel-received") else None
        if m == "committed":
            if name == "spawn-requested":
                return "starting"
            return "aborted" if name in ("cancel-received", "launch-failed") else None
        if m == "starting" and name == "launch-failed":
            return "aborted"
        if m in ("starting", "running", "cancelling"):
            if name == "exit-observed":
                return "exited"
            if name == "runner-vanished":
                return "lost"
            if name == "cancel-received" and m != "cancelling":
                return "cancelling"
            if name == "runner-started" and m == "starting":
                return "running"
            if name == "runner-started" and m == "cancelling":
                return "cancelling"
        return None

    @rule(event=st.sampled_from(list(E)))
    def step(self, event: MemberEvent) -> None:
        expected = self._model_step(event)
        if expected is None:
            with pytest.raises(IllegalTransition):
                next_state(self.state, event)
        else:
            self.state = next_state(self.state, event)
            self.model = expected
            if event is E.SPAWN_REQUESTED:
                assert not self.started, "a member was spawned twice"
                self.started = True

    @invariant()
    def agree(self) -> None:
        assert self.state.value == self.model

    @invariant()
    def exit_only_after_spawn(self) -> None:
        if self.state in (S.EXITED, S.LOST, S.RUNNING, S.CANCELLING):
            assert self.started


TestLifecycle = Lifecycle.TestCase
