"""Group commit's pure core: what goes into a batch, by example and against a model
(Hypothesis state machine)."""

from __future__ import annotations

import itertools
from collections import deque

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tuneplane.coordinator.group_commit import (
    GroupCommit,
    GroupCommitMisuse,
    GroupCommitStatistics,
    Ticket,
    TicketState,
)


def weighed(max_items: int = 10, max_weight: int = 100) -> GroupCommit[int, str]:
    """Items are their own weight."""
    return GroupCommit(lambda item: item, max_items, max_weight)


def test_nothing_queued_cuts_nothing() -> None:
    core = weighed()
    assert core.cut() == []
    assert core.statistics() == GroupCommitStatistics(0, 0, 0, 0, 0)


def test_a_lone_write_is_a_batch_of_one() -> None:
    core = weighed()
    ticket = core.submit(3)
    states = [ticket.state]
    assert core.cut() == [ticket]
    states.append(ticket.state)
    assert states == [TicketState.QUEUED, TicketState.RUNNING]
    core.answer(ticket, "done")
    assert ticket.outcome() == "done"
    assert core.statistics() == GroupCommitStatistics(0, 0, 1, 1, 1)


def test_everything_queued_goes_in_the_order_it_came() -> None:
    core = weighed()
    tickets = [core.submit(i) for i in (5, 1, 4)]
    assert core.cut() == tickets
    assert core.cut() == []


def test_a_batch_stops_at_max_items_and_the_rest_waits() -> None:
    core = weighed(max_items=2)
    a, b, c = (core.submit(1) for _ in range(3))
    assert core.cut() == [a, b]
    assert c.state is TicketState.QUEUED
    assert core.cut() == [c]


def test_a_batch_stops_before_max_weight() -> None:
    core = weighed(max_weight=10)
    a, b, c = core.submit(6), core.submit(4), core.submit(1)
    assert core.cut() == [a, b]  # 10: exactly the limit
    assert core.cut() == [c]


def test_the_oldest_goes_even_when_it_alone_is_too_heavy() -> None:
    core = weighed(max_weight=10)
    heavy, light = core.submit(50), core.submit(1)
    assert core.cut() == [heavy]
    assert core.cut() == [light]


def test_a_weight_below_one_counts_as_one() -> None:
    core = weighed(max_weight=2)
    tickets = [core.submit(0) for _ in range(3)]
    assert [t.weight for t in tickets] == [1, 1, 1]
    assert core.cut() == tickets[:2]


def test_an_error_is_raised_to_its_waiter() -> None:
    core = weighed()
    ticket = core.submit(1)
    core.cut()
    core.fail(ticket, ValueError("the Node row is gone"))
    with pytest.raises(ValueError, match="the Node row is gone"):
        ticket.outcome()


def test_only_a_running_ticket_is_answered_and_only_once() -> None:
    core = weighed()
    ticket = core.submit(1)
    with pytest.raises(GroupCommitMisuse, match="queued"):
        core.answer(ticket, "early")
    with pytest.raises(GroupCommitMisuse, match="no outcome yet"):
        ticket.outcome()
    core.cut()
    core.answer(ticket, "once")
    with pytest.raises(GroupCommitMisuse, match="answered"):
        core.fail(ticket, RuntimeError("twice"))
    assert ticket.outcome() == "once"


@pytest.mark.parametrize(("items", "weight"), [(0, 5), (5, 0), (-1, -1)])
def test_limits_leave_room_for_one_write(items: int, weight: int) -> None:
    with pytest.raises(ValueError, match="room for one write"):
        GroupCommit(lambda _i: 1, items, weight)


@given(
    st.lists(st.integers(0, 30), max_size=60),
    st.integers(1, 8),
    st.integers(1, 40),
)
def test_batches_partition_the_queue_in_order_within_the_limits(
    weights: list[int], max_items: int, max_weight: int
) -> None:
    core = weighed(max_items, max_weight)
    tickets = [core.submit(w) for w in weights]
    batches = []
    while batch := core.cut():
        batches.append(batch)
    assert [t for b in batches for t in b] == tickets
    for b in batches:
        assert 1 <= len(b) <= max_items
        total = sum(t.weight for t in b)
        assert total <= max_weight or len(b) == 1
    # Greedy: a batch ends only where the next ticket would break a limit.
    for b, nxt in itertools.pairwise(batches):
        assert len(b) == max_items or sum(t.weight for t in b) + nxt[0].weight > max_weight
    stats = core.statistics()
    assert (stats.queued, stats.running, stats.batches, stats.tickets) == (
        0,
        len(weights),
        len(batches),
        len(weights),
    )


class GroupCommitMachine(RuleBasedStateMachine):
    """Submits, cuts and answers in any order, against a plain model: a FIFO of waiting items
    and a set of running ones."""

    def __init__(self) -> None:
        super().__init__()
        self.core: GroupCommit[int, str] = weighed(max_items=4, max_weight=12)
        self.waiting: deque[Ticket[int, str]] = deque()
        self.running: list[Ticket[int, str]] = []
        self.answered: dict[Ticket[int, str], str | None] = {}
        self.batches = 0
        self.largest = 0

    @rule(weight=st.integers(0, 15))
    def submit(self, weight: int) -> None:
        self.waiting.append(self.core.submit(weight))

    @rule()
    def cut(self) -> None:
        batch = self.core.cut()
        if not self.waiting:
            assert batch == []
            return
        expected = [self.waiting.popleft()]
        while self.waiting and len(expected) < 4:
            if sum(t.weight for t in expected) + self.waiting[0].weight > 12:
                break
            expected.append(self.waiting.popleft())
        assert batch == expected
        self.running += batch
        self.batches += 1
        self.largest = max(self.largest, len(batch))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), ok=st.booleans())
    def answer(self, data: st.DataObject, ok: bool) -> None:
        ticket = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        if ok:
            self.core.answer(ticket, f"r{id(ticket)}")
            self.answered[ticket] = f"r{id(ticket)}"
        else:
            self.core.fail(ticket, LookupError("gone"))
            self.answered[ticket] = None

    @precondition(lambda self: self.answered)
    @rule(data=st.data())
    def answering_again_is_refused(self, data: st.DataObject) -> None:
        ticket = data.draw(st.sampled_from(sorted(self.answered, key=id)))
        with pytest.raises(GroupCommitMisuse):
            self.core.answer(ticket, "again")

    @invariant()
    def states_and_outcomes_match_the_model(self) -> None:
        assert all(t.state is TicketState.QUEUED for t in self.waiting)
        assert all(t.state is TicketState.RUNNING for t in self.running)
        for ticket, result in self.answered.items():
            assert ticket.state is TicketState.ANSWERED
            if result is None:
                with pytest.raises(LookupError):
                    ticket.outcome()
            else:
                assert ticket.outcome() == result
        tickets = len(self.running) + len(self.answered)
        assert self.core.statistics() == GroupCommitStatistics(
            len(self.waiting), len(self.running), self.batches, self.largest, tickets
        )


def test_group_commit_against_its_model() -> None:
    # A function, not GroupCommitMachine.TestCase: a unittest case takes no fixtures, and every
    # test here gets the autouse store backend.
    run_state_machine_as_test(GroupCommitMachine)
