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
  the Connects ahead of it would take longer than that to clear at the rate Welcomes have been
  completing (an exponentially weighted average per second). Its Node dials again after its
  jittered backoff.
- A refused Connect is told when to dial again (:meth:`HelloGate.come_back_in`): a turn of its
  own, after the Connects ahead of it and after the turns given to those refused before it,
  spaced at the measured rate a little overbooked (:attr:`GateSettings.overbook`, so the rate
  can still be seen to grow; the overbooked few wait in line or are given a later turn). Without
  it every refused Node came back within its backoff window and most were refused again (five
  or six times each for 5,000 Nodes); with it each is refused about once.
- The rate's first measured second is taken as it is, not blended with the 0 before it, so the
  first turns given are not twice as far apart as the rate allows. Only a saturated second (a
  Connect found every turn taken) is folded in as it is, a second with Connects stuck and none
  welcomed (a store that does not answer) lowering the rate: only then is the count what the
  coordinator can do. A quieter second only raises the rate when it welcomed more; otherwise a
  handful of Nodes dialing now and then would set the turns of the next storm far apart.
- A refused Connect costs the coordinator no store read, and a waiting one nothing but its
  stream.
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
    #: Weight of the latest second's Welcomes in the rate.
    smoothing: float = 0.5
    #: Turns given to refused Connects come this much faster than the measured rate.
    overbook: float = 1.25
    #: The latest turn a refusal gives; later ones are all given this (a Node told to wait
    #: longer could as well have stayed on its own backoff).
    max_come_back_s: float = 60.0


@attrs.define
class HelloGate:
    """The Connects waiting and worked on, and the rate Welcomes complete at."""

    settings: GateSettings = attrs.field(factory=GateSettings)
    waiting: int = 0
    in_flight: int = 0
    #: Welcomes per second, smoothed; 0 until a second with a Welcome has passed.
    rate: float = 0.0
    #: Connects refused as busy so far.
    deferred: int = 0
    _second_started: float | None = None
    _welcomed_this_second: int = 0
    #: Whether a Connect found every turn taken in the current second.
    _saturated_this_second: bool = False
    #: When the last turn given to a refused Connect ends (monotonic seconds).
    _booked_until: float = 0.0

    def arrive(self, now: float) -> bool:
        """A Connect arrived at ``now`` (monotonic seconds): True when it is to wait for its
        turn (then :meth:`start` or :meth:`gave_up`), False when it is refused as busy now."""
        self._roll(now)
        ahead = self.waiting + self.in_flight
        if ahead >= self.settings.concurrency:
            self._saturated_this_second = True
        if ahead >= self.settings.concurrency and self.rate > 0:
            clear_s = (ahead - self.settings.concurrency + 1) / self.rate
            if clear_s > self.settings.max_wait_s:
                self.deferred += 1
                return False
        self.waiting += 1
        return True

    def start(self, now: float) -> None:
        """A waiting Connect got its turn."""
        self._roll(now)
        self.waiting -= 1
        self.in_flight += 1

    def gave_up(self, now: float) -> None:
        """A waiting Connect waited :attr:`GateSettings.max_wait_s` and is refused as busy."""
        self._roll(now)
        self.waiting -= 1
        self.deferred += 1

    def left(self, now: float) -> None:
        """A waiting Connect ended before its turn (its Node hung up)."""
        self._roll(now)
        self.waiting -= 1

    def done(self, now: float, welcomed: bool) -> None:
        """A Connect worked on was welcomed (counted in the rate) or failed before."""
        self._roll(now)
        self.in_flight -= 1
        if welcomed:
            self._welcomed_this_second += 1

    def come_back_in(self, now: float) -> float | None:
        """For a Connect just refused at ``now``: the seconds until its turn, when its Node
        should dial again. None while no rate is measured (the Node keeps to its backoff)."""
        if self.rate <= 0:
            return None
        pace = 1.0 / (self.rate * self.settings.overbook)
        clears_at = now + (self.waiting + self.in_flight) * pace
        turn = max(clears_at, self._booked_until)
        self._booked_until = turn + pace
        return min(turn - now, self.settings.max_come_back_s)

    def _roll(self, now: float) -> None:
        """Fold every whole second since the last into the rate."""
        if self._second_started is None:
            self._second_started = now
            return
        if now - self._second_started > 60:
            # Quiet for a minute: start afresh.
            self._second_started, self._welcomed_this_second, self.rate = now, 0, 0.0
            self._saturated_this_second = self.waiting > 0
            return
        while now - self._second_started >= 1.0:
            count = self._welcomed_this_second
            if self._saturated_this_second or count > self.rate:
                weight = self.settings.smoothing if self.rate > 0 else 1.0
                self.rate = (1 - weight) * self.rate + weight * count
            self._welcomed_this_second = 0
            # A Connect still waiting for its turn makes the next second saturated too.
            self._saturated_this_second = self.waiting > 0
            self._second_started += 1.0

    def busy_sentence(self, come_back_s: float | None) -> str:
        then = (
            "after its backoff"
            if come_back_s is None
            else f"in about {come_back_s:.1f} s, its turn"
        )
        return (
            f"the coordinator is welcoming {self.in_flight} Nodes with {self.waiting} more "
            f"waiting (about {self.rate:.0f} a second); this Node dials again {then}"
        )


@attrs.define
class Ticket:
    """One Connect's turn: :meth:`welcomed` once its Welcome is sent, :meth:`release` when it
    ends (either may come first). The gate hears of it once, and ``free`` (the shell's slot)
    is called once: the turn ends at Welcome, not with the session."""

    gate: HelloGate
    clock: Callable[[], float]
    free: Callable[[], None]
    _open: bool = True

    def welcomed(self) -> None:
        self._end(welcomed=True)

    def release(self) -> None:
        self._end(welcomed=False)

    def _end(self, welcomed: bool) -> None:
        if self._open:
            self._open = False
            self.gate.done(self.clock(), welcomed)
            self.free()
