"""Group commit, the pure part: which waiting writes go into the next transaction, and who
has their answer.

Theory of operation: after a coordinator restart or a takeover every Node says Hello at once,
and one write transaction per Hello (a commit, an fsync on SQLite, a round trip and the term
check on PostgreSQL) made 5,000 Hellos take minutes. So writes of one kind queue as *tickets*;
whoever finds a ticket of its own still queued when its turn comes cuts a *batch* (everything
queued, within the limits) and writes it in one transaction; the others find theirs answered.
A queue that is empty when a write arrives costs nothing: that write is a batch of one.

Rules:
- First come, first cut: a batch is the oldest queued tickets in the order they came, so the
  writes inside one transaction happen in the order a one-at-a-time store would have made them.
- A batch is never empty and holds at most ``max_items`` tickets and ``max_weight`` weight
  (a ticket weighs what its write costs, e.g. 1 + the members a Hello holds); the oldest ticket
  goes even when it alone weighs more, so nothing waits forever.
- A ticket moves queued -> running (cut) -> answered (a result or an error) and never back;
  answering a ticket twice, or one that was never cut, is a :class:`GroupCommitMisuse`.
- Nothing here reads a clock, waits or touches the store: the store's shell
  (:mod:`~tuneplane.coordinator.store.hello_batches`) awaits, writes and wakes the waiters.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

import attrs

T = TypeVar("T")
R = TypeVar("R")

#: Default limits: a Hello batch this big is one transaction of a few hundred milliseconds.
MAX_ITEMS = 500
MAX_WEIGHT = 2000


class GroupCommitMisuse(RuntimeError):
    """A shell answered a ticket that was not running (a bug in the shell, never the user's)."""


class TicketState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    ANSWERED = "answered"


@attrs.define(eq=False)
class Ticket(Generic[T, R]):
    """One write waiting for its transaction: its ``item``, then its result or its error."""

    item: T
    weight: int
    state: TicketState = TicketState.QUEUED
    _result: R | None = attrs.field(default=None, init=False)
    _error: BaseException | None = attrs.field(default=None, init=False)

    def outcome(self) -> R:
        """The write's result, or its error raised; only once it is answered."""
        if self.state is not TicketState.ANSWERED:
            raise GroupCommitMisuse(f"a ticket that is {self.state.value} has no outcome yet.")
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]

    def _settle(self, result: R | None, error: BaseException | None) -> None:
        if self.state is TicketState.ANSWERED:
            raise GroupCommitMisuse("this ticket is answered already.")
        self.state = TicketState.ANSWERED
        self._result, self._error = result, error


@attrs.frozen
class GroupCommitStatistics:
    """What a :class:`GroupCommit` has done: tickets queued now and running, batches cut, the
    largest batch, and how many tickets went through batches in all."""

    queued: int
    running: int
    batches: int
    largest: int
    tickets: int


@attrs.define
class GroupCommit(Generic[T, R]):
    """The queue of writes waiting for a transaction, and the rules that cut it into batches."""

    weigh: Callable[[T], int] = attrs.field(default=lambda _item: 1)
    max_items: int = attrs.field(default=MAX_ITEMS)
    max_weight: int = attrs.field(default=MAX_WEIGHT)
    _queue: deque[Ticket[T, R]] = attrs.field(factory=deque, init=False)
    _running: int = attrs.field(default=0, init=False)
    _batches: int = attrs.field(default=0, init=False)
    _largest: int = attrs.field(default=0, init=False)
    _tickets: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self) -> None:
        if self.max_items < 1 or self.max_weight < 1:
            raise ValueError(
                f"a group commit needs room for one write (max_items={self.max_items}, "
                f"max_weight={self.max_weight}); give both limits 1 or more."
            )

    def submit(self, item: T) -> Ticket[T, R]:
        """Queue ``item`` for the next batch; the ticket is answered after it is written."""
        ticket: Ticket[T, R] = Ticket(item, max(1, self.weigh(item)))
        self._queue.append(ticket)
        return ticket

    def cut(self) -> list[Ticket[T, R]]:
        """The next batch (oldest first, within the limits), now running; [] when none waits."""
        batch: list[Ticket[T, R]] = []
        weight = 0
        while self._queue and len(batch) < self.max_items:
            nxt = self._queue[0]
            if batch and weight + nxt.weight > self.max_weight:
                break
            self._queue.popleft()
            nxt.state = TicketState.RUNNING
            batch.append(nxt)
            weight += nxt.weight
        if batch:
            self._running += len(batch)
            self._batches += 1
            self._tickets += len(batch)
            self._largest = max(self._largest, len(batch))
        return batch

    def answer(self, ticket: Ticket[T, R], result: R) -> None:
        """``ticket``'s write is durable and this is what it returned."""
        self._running_only(ticket)
        ticket._settle(result, None)
        self._running -= 1

    def fail(self, ticket: Ticket[T, R], error: BaseException) -> None:
        """``ticket``'s write did not happen, for ``error`` (raised to its waiter)."""
        self._running_only(ticket)
        ticket._settle(None, error)
        self._running -= 1

    @staticmethod
    def _running_only(ticket: Ticket[T, R]) -> None:
        if ticket.state is not TicketState.RUNNING:
            raise GroupCommitMisuse(
                f"only a running ticket is answered, and this one is {ticket.state.value}."
            )

    def statistics(self) -> GroupCommitStatistics:
        return GroupCommitStatistics(
            len(self._queue), self._running, self._batches, self._largest, self._tickets
        )
