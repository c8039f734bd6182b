"""The Node's answer to Commit, Abort and Cancel (agent/member_commands.py), exhaustively.

Every command meets every journaled state; whatever is journaled is a legal move of the member
lifecycle, a start only follows a Commit, a stop only a Cancel of a started member, and a
Hypothesis sequence of orders (repeats, late and out-of-order copies) journals Commit at most
once and never starts a member the coordinator aborted or cancelled.
"""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from tuneplane.agent.member_commands import Command, Response, respond
from tuneplane.agent.member_state import (
    COMMITTED_OR_LATER,
    MemberEvent,
    MemberState,
    next_state,
)

S = MemberState
E = MemberEvent
STATES = (None, *MemberState)


def test_every_command_in_every_state_journals_only_legal_moves() -> None:
    for command, state in itertools.product(Command, STATES):
        answer = respond(command, state)
        if answer.event is None:
            # Nothing journaled: either a start resumed or a note saying why nothing happens.
            assert answer.start != bool(answer.note), (command, state)
            assert not answer.start or state in (S.COMMITTED, S.STARTING)
            continue
        assert state is not None
        after = next_state(state, answer.event)  # raises on an illegal move
        if answer.start:
            assert command is Command.COMMIT and after is S.COMMITTED
        if answer.stop:
            assert command is Command.CANCEL and after is S.CANCELLING


def test_the_rows_of_the_table() -> None:
    assert respond(Command.COMMIT, S.PREPARED) == Response(E.COMMIT_RECEIVED, start=True)
    for resumed in (S.COMMITTED, S.STARTING):
        assert respond(Command.COMMIT, resumed) == Response(start=True)
    for wrong in (S.ABORTED, None):
        assert respond(Command.COMMIT, wrong).error
    for state in (S.PREPARING, S.PREPARED):
        assert respond(Command.ABORT, state) == Response(E.ABORT_RECEIVED, release_rendezvous=True)
    for state in COMMITTED_OR_LATER:
        answer = respond(Command.ABORT, state)
        assert answer.event is None and answer.error
    for state in (S.PREPARED, S.COMMITTED):
        answer = respond(Command.CANCEL, state)
        assert answer == Response(E.CANCEL_RECEIVED, release_rendezvous=True)
    for state in (S.STARTING, S.RUNNING):
        assert respond(Command.CANCEL, state) == Response(E.CANCEL_RECEIVED, stop=True)
    assert not respond(Command.ABORT, None).error  # an Abort for nothing is routine


# The supervision events that move a started member on by themselves.
RUNS = {S.COMMITTED: E.SPAWN_REQUESTED, S.STARTING: E.RUNNER_STARTED, S.RUNNING: E.EXIT_OBSERVED}


@given(
    prepared=st.booleans(),
    orders=st.lists(
        st.one_of(st.sampled_from(list(Command)), st.just("supervise")), min_size=1, max_size=12
    ),
)
def test_any_order_of_orders_commits_at_most_once(
    prepared: bool, orders: list[Command | str]
) -> None:
    state = S.PREPARED if prepared else S.PREPARING
    commits = 0
    ended = False  # aborted or cancelled: nothing may start from here on
    for order in orders:
        if order == "supervise":
            if state in RUNS:
                state = next_state(state, RUNS[state])
            continue
        assert isinstance(order, Command)
        answer = respond(order, state)
        if answer.event is not None:
            state = next_state(state, answer.event)
            commits += answer.event is E.COMMIT_RECEIVED
        if answer.start:
            assert not ended and state in (S.COMMITTED, S.STARTING)
        ended = ended or state in (S.ABORTED, S.CANCELLING, S.EXITED)
    assert commits <= 1
