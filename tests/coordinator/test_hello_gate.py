"""The reconnect-storm gate (coordinator/hello_gate.py), pure: who waits, who is refused, the rate
it measures and the turns it gives."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tuneplane.coordinator.hello_gate import GateSettings, HelloGate, Ticket

SMALL = GateSettings(concurrency=2, max_wait_s=1.0, smoothing=0.5)


def _welcome(gate: HelloGate, at: float, took: float) -> None:
    """One Connect that arrives at ``at``, gets its turn at once and is welcomed ``took`` later."""
    assert gate.arrive(at)
    gate.start(at)
    gate.done(at + took, welcomed=True, started_at=at)


def test_connects_wait_for_a_turn_until_the_rate_says_they_would_wait_too_long() -> None:
    gate = HelloGate(SMALL)
    # No Welcome yet, no rate: everyone may wait (each waits at most max_wait_s in the shell).
    assert all(gate.arrive(0.0) for _ in range(10))
    assert (gate.waiting, gate.deferred) == (10, 0)
    for _ in range(10):
        gate.gave_up(0.5)
    assert (gate.waiting, gate.deferred) == (0, 10)
    # A turn takes 2 s: two turns welcome one Node a second.
    _welcome(gate, 1.0, took=2.0)
    assert gate.turn_s == 2.0 and gate.rate == 1.0
    for _ in range(2):
        assert gate.arrive(3.0)
        gate.start(3.0)
    # Two in flight: the next clears after 1 of them, 1 s at 1 a second: not over max_wait_s.
    assert gate.arrive(3.0)
    # The one after that would wait 2 s: refused now, counted.
    assert not gate.arrive(3.0)
    assert gate.deferred == 11
    come_back = gate.come_back_in(3.0)
    assert come_back is not None
    assert "welcoming 2 Nodes with 1 more waiting" in gate.busy_sentence(come_back)
    assert f"dials again in about {come_back:.1f} s, its turn" in gate.busy_sentence(come_back)
    assert "after its backoff" in gate.busy_sentence(None)


def test_a_connect_that_can_wait_in_line_waits_up_to_the_lines_bound_instead() -> None:
    gate = HelloGate(GateSettings(concurrency=2, max_wait_s=1.0, max_queue_s=5.0, smoothing=0.5))
    assert gate.expected_wait() == 0.0  # a turn is free
    for _ in range(2):
        assert gate.arrive(0.0)
        gate.start(0.0)
    assert gate.expected_wait() is None  # every turn taken, and no rate measured yet
    gate.done(2.0, welcomed=True, started_at=0.0)  # a turn takes 2 s: 1 a second
    gate.done(2.0, welcomed=False, started_at=0.0)
    for _ in range(2):
        assert gate.arrive(1.0)
        gate.start(1.0)
    assert gate.longest_wait(patient=False) == 1.0 and gate.longest_wait(patient=True) == 5.0
    # Four in line would clear in 1, 2, 3, 4 s: past 1 s only the patient are taken on.
    assert gate.arrive(1.0, patient=False)
    assert not gate.arrive(1.0, patient=False)
    for wait in (2.0, 3.0, 4.0, 5.0):
        assert gate.expected_wait() == wait
        assert gate.arrive(1.0, patient=True)
    assert gate.expected_wait() == 6.0
    assert not gate.arrive(1.0, patient=True)
    assert (gate.waiting, gate.deferred) == (5, 2)
    assert "expected in about 6.0 s" in gate.queued_sentence(6.0)


def test_no_line_makes_a_patient_connect_wait_as_others_do() -> None:
    gate = HelloGate(GateSettings(concurrency=1, max_wait_s=1.0, max_queue_s=0.0))
    assert gate.longest_wait(patient=True) == 1.0


def test_the_time_a_turn_takes_is_smoothed_over_welcomes_and_failures_do_not_count() -> None:
    gate = HelloGate(SMALL)
    _welcome(gate, 0.0, took=4.0)
    _welcome(gate, 5.0, took=2.0)
    assert gate.turn_s == 3.0  # 0.5 * 4 + 0.5 * 2
    gate.arrive(9.0)
    gate.start(9.0)
    gate.done(30.0, welcomed=False, started_at=9.0)  # its Node hung up: no Welcome, no time
    assert gate.turn_s == 3.0 and gate.in_flight == 0
    # A minute of silence changes nothing: the next storm starts from what the last one took.
    assert gate.come_back_in(100.0) == pytest.approx(0.0)


def test_a_ticket_ends_its_turn_once_at_welcome_or_at_the_end() -> None:
    freed: list[int] = []
    gate = HelloGate(SMALL)
    gate.arrive(0.0)
    gate.start(0.0)
    ticket = Ticket(gate, lambda: 0.5, lambda: freed.append(1), 0.0)
    ticket.welcomed()
    ticket.release()  # the session ended hours later: nothing more to count
    assert freed == [1] and gate.in_flight == 0 and gate.turn_s == 0.5
    gate.arrive(0.6)
    gate.start(0.6)
    failed = Ticket(gate, lambda: 0.7, lambda: freed.append(2), 0.6)
    failed.release()
    failed.welcomed()
    assert freed == [1, 2] and gate.in_flight == 0 and gate.turn_s == 0.5


def _measured(rate_per_s: float, settings: GateSettings = SMALL) -> HelloGate:
    """A gate whose turns were seen to welcome ``rate_per_s`` Nodes a second."""
    gate = HelloGate(settings)
    _welcome(gate, 0.0, took=settings.concurrency / rate_per_s)
    assert gate.rate == pytest.approx(rate_per_s)
    return gate


def test_no_turn_is_named_before_a_welcome() -> None:
    gate = HelloGate(SMALL)
    for _ in range(5):
        gate.arrive(0.0)
    assert gate.come_back_in(0.5) is None


def test_refused_connects_are_given_turns_one_after_another_at_the_overbooked_rate() -> None:
    gate = _measured(10)  # 10 a second, overbooked 1.25: a turn every 0.08 s
    for _ in range(3):
        gate.arrive(1.0)
        gate.start(1.0)
    # 3 ahead: the first refused is due when they clear, the next ones a pace apart.
    turns = [gate.come_back_in(1.0) for _ in range(4)]
    assert turns == pytest.approx([0.24, 0.32, 0.40, 0.48])
    # Later refusals line up after the turns already given, measured from their own now.
    assert gate.come_back_in(1.1) == pytest.approx(0.46)
    # Once the booked turns are past, a refusal is due when the Connects ahead clear.
    assert gate.come_back_in(10.0) == pytest.approx(0.24)


def test_turns_stop_at_the_latest_a_refusal_may_name() -> None:
    gate = _measured(1, GateSettings(concurrency=2, max_wait_s=1.0, max_come_back_s=5.0))
    turns = [gate.come_back_in(1.0) for _ in range(10)]
    assert max(t for t in turns if t is not None) == 5.0
    assert turns[:5] == pytest.approx([0.0, 0.8, 1.6, 2.4, 3.2])


@given(
    st.integers(1, 500),
    st.lists(st.tuples(st.floats(0, 2), st.integers(0, 300)), min_size=1, max_size=60),
)
def test_no_two_refusals_share_a_turn_and_none_comes_before_the_connects_ahead(
    rate: int, refusals: list[tuple[float, int]]
) -> None:
    settings = GateSettings(concurrency=2, max_wait_s=1.0, max_come_back_s=1e9)
    gate = _measured(rate, settings)
    pace = 1 / (gate.rate * settings.overbook)
    now, due = 1.0, []
    for dt, ahead in refusals:
        now += dt
        gate.waiting = ahead
        turn = gate.come_back_in(now)
        assert turn is not None
        assert turn >= ahead * pace - 1e-9
        due.append(now + turn)
    due.sort()
    assert all(b - a >= pace - 1e-9 for a, b in itertools.pairwise(due))


@given(st.lists(st.tuples(st.sampled_from("awgldx"), st.floats(0, 3)), max_size=80))
def test_the_counts_never_go_negative_whatever_happens(steps: list[tuple[str, float]]) -> None:
    """A shell that follows the protocol (start/gave_up/left only for a waiting Connect, done
    only for one started) keeps every count at or above zero and refuses nobody it let wait."""
    gate = HelloGate(SMALL)
    now = 0.0
    started: list[float] = []
    for op, dt in steps:
        now += dt
        if op == "a":
            gate.arrive(now)
        elif op == "w" and gate.waiting:
            gate.start(now)
            started.append(now)
        elif op == "g" and gate.waiting:
            gate.gave_up(now)
        elif op == "l" and gate.waiting:
            gate.left(now)
        elif op in "dx" and started:
            gate.done(now, welcomed=op == "d", started_at=started.pop())
        assert gate.waiting >= 0 and gate.in_flight >= 0 and gate.rate >= 0
