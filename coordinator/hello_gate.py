"""How the coordinator takes on Connects in a reconnect storm (pure: no I/O, no clock).

Rules:
- A Node waits :data:`~tuneplane.agent.session.WELCOME_TIMEOUT_S` (10 s) for its Welcome, then
  gives up and dials again. A coordinator that took on every Connect of thousands of Nodes at
  once would answer the later ones after that deadline. Each abandoned Hello is work thrown
  away, and the redials feed on themselves (measured: 5,000 Nodes never all welcomed).
- So at most :attr:`GateSettings.concurrency` Connects are worked on at once (authenticated,
  their Hello read, stored, welcomed). The others wait their turn in arrival order, each for at
  most :attr:`GateSettings.max_wait_s`, which leaves it time to be welcomed before its Node's
  deadline. One still waiting then is refused as busy (UNAVAILABLE), and so is one arriving when
  the Connects ahead of it would take longer than that to clear at the welcome rate.
- The welcome rate is what the turns can do: :attr:`GateSettings.concurrency` over the time a
  Connect takes from its turn to its Welcome, smoothed over the Connects welcomed (Little's law).
  Welcomes counted per second would not do: Hellos are stored in group commits, so whole
  seconds pass with none while hundreds are on their way, and a count that drops to 0 with them
  sets the next turns far apart. An optimistic rate corrects itself within a few Welcomes (the
  Nodes it called too early wait in line or are given another turn); a pessimistic one would
  leave the coordinator idle while Nodes wait for turns it set too late.
- A refused Connect is told when to dial again (:meth:`HelloGate.come_back_in`): a turn of its
  own, after the Connects ahead of it and after the turns given to those refused before it,
  spaced at the welcome rate a little overbooked (:attr:`GateSettings.overbook`; the overbooked
  few wait in line or are given a later turn). Without it every refused Node came back within
  its backoff window and most were refused again.
- A Node whose agent announced it can wait in line
  (:attr:`~tuneplane.proto.contract.control_protocol.Capability.QUEUED_CONNECT`) is told its
  place at once, with the wait expected, and waits up to :attr:`GateSettings.max_queue_s`
  instead: each refusal costs both sides a Connect, and in a 5,000-Node storm the Nodes
  refused, told their turns and refused again were most of the coordinator's work. Only one
  whose wait would be longer still is refused.
- A refused Connect costs the coordinator no store read, and a waiting one nothing but its
  stream (a Node waiting in line was authenticated first, so the line holds only Nodes).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs


@attrs.frozen
class GateSettings:
    #: Connects worked on at once: enough for the Hello group commit to write large groups.
    concurrency: int = 256
    #: The longest a Connect waits for its turn: its Node has 10 s for the whole Welcome.
    max_wait_s: float = 5.0
    #: The longest a Connect that can wait in line (its Node was told its place) waits for its
    #: turn; 0: such Connects wait as others do.
    max_queue_s: float = 60.0
    #: Weight of the latest Welcome's time in the smoothed time a turn takes.
    smoothing: float = 0.1
    #: Turns given to refused Connects come this much faster than the welcome rate.
    overbook: float = 1.25
    #: The latest turn a refusal gives; later ones are all given this (a Node told to wait
    #: longer could as well have stayed on its own backoff).
    max_come_back_s: float = 60.0


@attrs.define
class HelloGate:
    """The Connects waiting and worked on, and how long a turn takes."""

    settings: GateSettings = attrs.field(factory=GateSettings)
    waiting: int = 0
    in_flight: int = 0
    #: Seconds from a Connect's turn to its Welcome, smoothed; None before the first Welcome.
    turn_s: float | None = None
    #: Connects refused as busy so far.
    deferred: int = 0
    #: When the last turn given to a refused Connect ends (monotonic seconds).
    _booked_until: float = 0.0

    @property
    def rate(self) -> float:
        """Welcomes a second with every turn taken; 0 before the first Welcome."""
        return 0.0 if self.turn_s is None else self.settings.concurrency / self.turn_s

    def longest_wait(self, patient: bool) -> float:
        """How long a Connect may wait for its turn: longer for one that can wait in line."""
        if patient:
            return max(self.settings.max_queue_s, self.settings.max_wait_s)
        return self.settings.max_wait_s

    def expected_wait(self) -> float | None:
        """Seconds a Connect arriving now would wait for its turn at the welcome rate (0 with a
        turn free); None before the first Welcome."""
        ahead = self.waiting + self.in_flight
        if ahead < self.settings.concurrency:
            return 0.0
        if self.rate <= 0:
            return None
        return (ahead - self.settings.concurrency + 1) / self.rate

    def arrive(self, now: float, patient: bool = False) -> bool:
        """A Connect arrived at ``now`` (monotonic seconds): True when it is to wait for its
        turn (then :meth:`start` or :meth:`gave_up`), False when it is refused as busy now.
        A ``patient`` one (its Node can wait in line) may wait :meth:`longest_wait`."""
        clear_s = self.expected_wait()
        if clear_s is not None and clear_s > self.longest_wait(patient):
            self.deferred += 1
            return False
        self.waiting += 1
        return True

    def start(self, now: float) -> None:
        """A waiting Connect got its turn."""
        self.waiting -= 1
        self.in_flight += 1

    def gave_up(self, now: float) -> None:
        """A waiting Connect waited :attr:`GateSettings.max_wait_s` and is refused as busy."""
        self.waiting -= 1
        self.deferred += 1

    def left(self, now: float) -> None:
        """A waiting Connect ended before its turn (its Node hung up)."""
        self.waiting -= 1

    def done(self, now: float, welcomed: bool, started_at: float) -> None:
        """A Connect worked on since ``started_at`` was welcomed (its time counted) or failed."""
        self.in_flight -= 1
        if welcomed:
            took = max(now - started_at, 1e-3)
            weight = self.settings.smoothing if self.turn_s is not None else 1.0
            self.turn_s = (1 - weight) * (self.turn_s or 0.0) + weight * took

    def come_back_in(self, now: float) -> float | None:
        """For a Connect just refused at ``now``: the seconds until its turn, when its Node
        should dial again. None before the first Welcome (the Node keeps to its backoff)."""
        if self.rate <= 0:
            return None
        pace = 1.0 / (self.rate * self.settings.overbook)
        clears_at = now + (self.waiting + self.in_flight) * pace
        turn = max(clears_at, self._booked_until)
        self._booked_until = turn + pace
        return min(turn - now, self.settings.max_come_back_s)

    def queued_sentence(self, wait_s: float) -> str:
        return (
            f"the coordinator is welcoming {self.in_flight} Nodes with {self.waiting} waiting "
            f"(this one among them); this Node's turn is expected in about {wait_s:.1f} s"
        )

    def busy_sentence(self, come_back_s: float | None) -> str:
        if come_back_s is None:
            then = "after its backoff"
        else:
            then = f"in about {come_back_s:.1f} s, its turn"
        return (
            f"the coordinator is welcoming {self.in_flight} Nodes with {self.waiting} more "
            f"waiting (about {self.rate:.0f} a second); this Node dials again {then}"
        )


@attrs.define
class Ticket:
    """One Connect's turn, started at ``started_at``: :meth:`welcomed` once its Welcome is sent,
    :meth:`release` when it ends (either may come first). The gate hears of it once, and
    ``free`` (the shell's slot) is called once: the turn ends at Welcome, not with the
    session."""

    gate: HelloGate
    clock: Callable[[], float]
    free: Callable[[], None]
    started_at: float
    _open: bool = True

    def welcomed(self) -> None:
        self._end(welcomed=True)

    def release(self) -> None:
        self._end(welcomed=False)

    def _end(self, welcomed: bool) -> None:
        if self._open:
            self._open = False
            self.gate.done(self.clock(), welcomed, self.started_at)
            self.free()
