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

    def arrive(self, now: float) -> bool:
        """A Connect arrived at ``now`` (monotonic seconds): True when it is to wait for its
        turn (then :meth:`start` or :meth:`gave_up`), False when it is refused as busy now."""
        self._roll(now)
        ahead = self.waiting + self.in_flight
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

    def _roll(self, now: float) -> None:
        """Fold every whole second since the last into the rate."""
        if self._second_started is None:
            self._second_started = now
            return
        if now - self._second_started > 60:
            # Quiet for a minute: start afresh.
            self._second_started, self._welcomed_this_second, self.rate = now, 0, 0.0
            return
        while now - self._second_started >= 1.0:
            weight = self.settings.smoothing
            self.rate = (1 - weight) * self.rate + weight * self._welcomed_this_second
            self._welcomed_this_second = 0
            self._second_started += 1.0

    def busy_sentence(self) -> str:
        return (
            f"the coordinator is welcoming {self.in_flight} Nodes with {self.waiting} more "
            f"waiting (about {self.rate:.0f} a second); this Node dials again after its backoff"
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
