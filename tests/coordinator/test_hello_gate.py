"""The reconnect-storm gate (coordinator/hello_gate.py), pure: who waits, who is refused, and the
rate it measures."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tuneplane.coordinator.hello_gate import GateSettings, HelloGate, Ticket

SMALL = GateSettings(concurrency=2, max_wait_s=1.0, smoothing=0.5)


def test_connects_wait_for_a_turn_until_a_measured_rate_says_they_would_wait_too_long() -> None:
    gate = HelloGate(SMALL)
    # No rate measured yet: everyone may wait (each waits at most max_wait_s in the shell).
    assert all(gate.arrive(0.0) for _ in range(10))
    assert (gate.waiting, gate.deferred) == (10, 0)
    for _ in range(10):
        gate.gave_up(0.5)
    assert (gate.waiting, gate.deferred) == (0, 10)
    # Two turns, both welcomed within the first second: the rate becomes 0.5 * 2 = 1 a second.
    for _ in range(2):
        assert gate.arrive(1.0)
        gate.start(1.0)
    gate.done(1.2, welcomed=True)
    gate.done(1.3, welcomed=True)
    assert gate.arrive(2.0) and gate.rate == 1.0
    gate.start(2.0)
    assert gate.arrive(2.0)  # ahead: 1 in flight; a turn is free
    gate.start(2.0)
    # Two in flight: the next clears after 1 of them, 1 s at 1 a second: not over max_wait_s.
    assert gate.arrive(2.0)
    # The one after that would wait 2 s: refused now, counted.
    assert not gate.arrive(2.0)
    assert gate.deferred == 11
    assert "welcoming 2 Nodes with 1 more waiting" in gate.busy_sentence()


def test_a_quiet_minute_forgets_the_rate() -> None:
    gate = HelloGate(SMALL)
    gate.arrive(0.0)
    gate.start(0.0)
    gate.done(0.1, welcomed=True)
    gate.arrive(1.5)
    assert gate.rate == 0.5
    gate.left(100.0)
    assert gate.rate == 0.0 and gate.waiting == 0


def test_a_ticket_ends_its_turn_once_at_welcome_or_at_the_end() -> None:
    freed: list[int] = []
    gate = HelloGate(SMALL)
    gate.arrive(0.0)
    gate.start(0.0)
    ticket = Ticket(gate, lambda: 0.5, lambda: freed.append(1))
    ticket.welcomed()
    ticket.release()  # the session ended hours later: nothing more to count
    assert freed == [1] and gate.in_flight == 0
    gate.arrive(0.6)
    gate.start(0.6)
    failed = Ticket(gate, lambda: 0.7, lambda: freed.append(2))
    failed.release()
    failed.welcomed()
    assert freed == [1, 2] and gate.in_flight == 0


@given(st.lists(st.tuples(st.sampled_from("awgldx"), st.floats(0, 3)), max_size=80))
def test_the_counts_never_go_negative_whatever_happens(steps: list[tuple[str, float]]) -> None:
    """A shell that follows the protocol (start/gave_up/left only for a waiting Connect, done
    only for one started) keeps every count at or above zero and refuses nobody it let wait."""
    gate = HelloGate(SMALL)
    now = 0.0
    for op, dt in steps:
        now += dt
        if op == "a":
            gate.arrive(now)
        elif op == "w" and gate.waiting:
            gate.start(now)
        elif op == "g" and gate.waiting:
            gate.gave_up(now)
        elif op == "l" and gate.waiting:
            gate.left(now)
        elif op in "dx" and gate.in_flight:
            gate.done(now, welcomed=op == "d")
        assert gate.waiting >= 0 and gate.in_flight >= 0 and gate.rate >= 0
