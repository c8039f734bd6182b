"""The launch protocol's Prepare order (coordinator/launch.py): member 0 first, then the rest.

Exhaustive over every small attempt, and a Hypothesis state machine that plays an attempt's
replies, coordinator restarts (the rule asked again from what the store holds) and repeats
against a plain model.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tuneplane.coordinator import launch
from tuneplane.coordinator.lifecycle import ABORT, COMMIT

DECISIONS = (None, COMMIT, ABORT)


@pytest.mark.parametrize("decision", DECISIONS)
@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_every_small_attempt(decision: str | None, count: int) -> None:
    for prepared in itertools.product((False, True), repeat=count):
        for port in (0, 29500):
            due = launch.prepares_due(decision, enumerate(prepared), port)
            expected = tuple(
                i
                for i, is_prepared in enumerate(prepared)
                if decision is None and not is_prepared and (i == 0 or port > 0)
            )
            assert due == expected, (decision, prepared, port)
            # Asking again gives the same answer: the rule remembers nothing.
            assert launch.prepares_due(decision, enumerate(prepared), port) == due


def test_a_fresh_attempt_prepares_member_0_alone() -> None:
    assert launch.prepares_due(None, [(0, False), (1, False), (2, False)], 0) == (0,)
    assert launch.prepares_due(None, [(0, False)], 0) == (0,)


def test_once_member_0_is_prepared_the_others_follow_in_order() -> None:
    assert launch.prepares_due(None, [(2, False), (0, True), (1, False)], 40000) == (1, 2)


def test_a_decided_attempt_prepares_nobody() -> None:
    for decision in (COMMIT, ABORT):
        assert launch.prepares_due(decision, [(0, False), (1, False)], 40000) == ()


def test_nonces_are_fresh_and_long() -> None:
    nonces = {launch.new_nonce() for _ in range(100)}
    assert len(nonces) == 100
    assert all(len(n) == 64 and int(n, 16) >= 0 for n in nonces)


class AttemptMachine(RuleBasedStateMachine):
    """One attempt of ``count`` members. The store holds prepared flags, the rendezvous port and
    the decision; what has been *sent* lives only in the Nodes (the model), as it does in life."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.prepared: dict[int, bool] = {}
        self.port = 0
        self.decision: str | None = None
        self.received: set[int] = set()  # members whose Node has received a Prepare
        self.received_with_port: dict[int, int] = {}

    @precondition(lambda self: self.count == 0)
    @rule(count=st.integers(min_value=1, max_value=6))
    def reserve(self, count: int) -> None:
        self.count = count
        self.prepared = dict.fromkeys(range(count), False)
        self._send()

    def _send(self) -> None:
        for index in launch.prepares_due(self.decision, self.prepared.items(), self.port):
            self.received.add(index)
            if index != 0:
                self.received_with_port[index] = self.port

    @precondition(lambda self: self.count > 0 and self.decision is None)
    @rule(data=st.data())
    def a_node_answers_prepared(self, data: st.DataObject) -> None:
        waiting = sorted(i for i in self.received if not self.prepared[i])
        if not waiting:
            return
        index = data.draw(st.sampled_from(waiting))
        self.prepared[index] = True
        if index == 0:
            self.port = 29500
        if all(self.prepared.values()):
            self.decision = COMMIT
        else:
            self._send()

    @precondition(lambda self: self.count > 0 and self.decision is None)
    @rule(data=st.data())
    def a_node_refuses(self, data: st.DataObject) -> None:
        waiting = sorted(i for i in self.received if not self.prepared[i])
        if waiting:
            data.draw(st.sampled_from(waiting))
            self.decision = ABORT

    @precondition(lambda self: self.count > 0)
    @rule()
    def the_coordinator_restarts_or_a_node_reconnects(self) -> None:
        before = set(self.received)
        self._send()
        # Only what was due anyway can be sent again; a decided attempt sends nothing.
        if self.decision is not None:
            assert self.received == before

    @invariant()
    def no_member_is_prepared_before_member_0_picked_the_rendezvous(self) -> None:
        for index in self.received - {0}:
            assert self.received_with_port[index] > 0
            assert self.prepared[0]

    @invariant()
    def member_0_is_always_asked_first(self) -> None:
        if self.count:
            assert 0 in self.received

    @invariant()
    def an_undecided_attempt_always_has_someone_to_hear_from(self) -> None:
        if self.count and self.decision is None:
            assert any(not self.prepared[i] for i in self.received)


def test_attempt_order() -> None:
    # A function, not AttemptMachine.TestCase: a unittest case takes no fixtures, and every test
    # here runs once per store backend (tests/coordinator/conftest.py).
    run_state_machine_as_test(
        AttemptMachine, settings=settings(max_examples=200, stateful_step_count=30)
    )
