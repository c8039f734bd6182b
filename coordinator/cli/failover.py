"""Which coordinator a call of ``tp`` asks next, and when it stops asking (pure: failures, times
and jitter in, steps out; nothing here reads a clock, a socket or a random number).

Theory of operation: two or three coordinators may share one store, and exactly one leads; the
others refuse connections on their API port until they lead, and during a takeover (a few
seconds) none accepts. So a call walks the API addresses it was given, starting with the one
that last answered, moves to the next at once when one does not answer, pauses briefly after a
whole round (jittered, :data:`FIRST_PAUSE_S` doubling to :data:`MAX_PAUSE_S`, so many ``tp``
processes do not come back in lockstep) and gives up once its ride-out has passed, with one
sentence naming each address tried and what it said.

Rules:
- A call not in :data:`RETRY_SAFE` is asked again only when it never reached a coordinator
  (the connection or its TLS handshake failed): it is never carried out twice.
- A refusal (the coordinator understood and said no) and a certificate the CA does not vouch
  for end the call at once: another try, or another coordinator of the store, says the same.
- With one address there is no one to take over: any failure ends the call at once.
"""

from __future__ import annotations

import attrs

from tuneplane.agent.call_failure import CallFailure, Kind

#: Calls that may be carried out twice with the same outcome: reads (WatchJob too), Preview (it
#: stores an immutable preview and creates no Job), Commit (idempotent per retry key), and those
#: that set a value or whose repeat says "already" (CancelJob, SetNodeScheduling,
#: SetControlAddress).
#: RetryJob, RevokeNode and DeclareNodeLost are not here: a repeat is another attempt, or a
#: refusal of something that was done.
RETRY_SAFE = frozenset(
    {
        "Preview",
        "Commit",
        "GetJob",
        "WatchJob",
        "ListJobs",
        "ListFleets",
        "GetFleet",
        "ListNodes",
        "GetNode",
        "GetLogs",
        "ListMetrics",
        "QuerySeries",
        "GetDelivery",
        "CancelJob",
        "SetNodeScheduling",
        "SetControlAddress",
    }
)
FIRST_PAUSE_S = 0.25
MAX_PAUSE_S = 2.0
#: With several addresses, how long a connection (TCP and TLS) may take before the next address
#: is tried: a host that is down answers nothing, and the call's whole deadline is too long.
CONNECT_WITHIN_S = 3.0
#: Failures that end a call whatever the address: asking again gets the same answer.
_FINAL = (Kind.REFUSED, Kind.UNVERIFIED)


def starting_with(addresses: tuple[str, ...], answered: str | None) -> tuple[str, ...]:
    """``addresses`` in their order, rotated to start with ``answered`` when it is one of them."""
    if answered not in addresses:
        return addresses
    at = addresses.index(answered)
    return addresses[at:] + addresses[:at]


def pause_s(rounds: int, jitter: float) -> float:
    """Seconds to wait after whole round number ``rounds`` (1, 2, ...) failed: the upper half of
    a window from :data:`FIRST_PAUSE_S` doubling to :data:`MAX_PAUSE_S`, placed by ``jitter``
    in [0, 1)."""
    if rounds < 1:
        return 0.0
    ceiling = min(MAX_PAUSE_S, FIRST_PAUSE_S * float(2 ** min(rounds - 1, 16)))
    return ceiling * (0.5 + min(max(jitter, 0.0), 1.0) / 2)


def connect_deadline_s(addresses: int, timeout_s: float) -> float:
    """How long the connection to one address may take: the call's deadline when it is the only
    one, else at most :data:`CONNECT_WITHIN_S`."""
    return timeout_s if addresses <= 1 else min(timeout_s, CONNECT_WITHIN_S)


@attrs.frozen
class Next:
    """Ask ``address`` after ``pause_s`` seconds (0: at once)."""

    address: str
    pause_s: float = 0.0


@attrs.frozen
class Stop:
    """End the call with ``failure``, told as a failure of ``address`` alone."""

    address: str
    failure: CallFailure


@attrs.frozen
class GiveUp:
    """Every address was asked until the ride-out passed; ``tried`` is what each said last."""

    tried: tuple[tuple[str, CallFailure], ...]
    tries: int
    elapsed_s: float

    def sentence(self, call: str, address_check: str) -> str:
        """One sentence naming each address and what it said, then what to check."""
        said = "; ".join(f"{address} {what_it_said(f)}" for address, f in self.tried)
        return (
            f"No coordinator answered {call} in {self.elapsed_s:.1f} s ({self.tries} tries): "
            f"{said}. Check that one of them is running and leads, and {address_check}."
        )


def what_it_said(failure: CallFailure) -> str:
    """A failure as the end of "ADDRESS ...", short enough to list several."""
    detail = failure.detail or failure.status or failure.kind.value
    if failure.kind is Kind.UNREACHABLE:
        return f"could not be reached ({detail})"
    if failure.kind is Kind.UNAVAILABLE:
        return f"could not serve it ({failure.status}: {failure.detail or 'no detail'})"
    if failure.kind is Kind.TIMED_OUT:
        return "did not answer in time"
    if failure.kind is Kind.TLS_FAILED:
        return f"failed the TLS handshake ({detail})"
    if failure.kind is Kind.BROKEN:
        return f"broke the connection ({detail})"
    if failure.kind is Kind.REFUSED:
        return f"refused it ({failure.status}: {detail})"
    return f"has a certificate the CA does not vouch for ({detail})"


@attrs.define(eq=False)
class Attempts:
    """One call's walk over ``order``: ask :attr:`address`, and on a failure do what
    :meth:`failed` returns. ``safe``: the call may be carried out twice (:data:`RETRY_SAFE`);
    times are seconds on one monotonic clock."""

    order: tuple[str, ...]
    safe: bool
    started_s: float
    ride_out_s: float
    _at: int = 0
    _rounds: int = 0
    _tries: int = 0
    _said: dict[str, CallFailure] = attrs.Factory(dict)

    def __attrs_post_init__(self) -> None:
        if not self.order:
            raise ValueError("a call needs at least one address to ask")

    @property
    def address(self) -> str:
        """The address to ask now."""
        return self.order[self._at]

    def failed(
        self, failure: CallFailure, reached: bool, now_s: float, jitter: float
    ) -> Next | Stop | GiveUp:
        """:attr:`address` failed with ``failure``; ``reached``: the request may have got to a
        coordinator (the connection was up when it failed)."""
        address = self.address
        self._tries += 1
        self._said[address] = failure
        if failure.kind in _FINAL or len(self.order) == 1 or (reached and not self.safe):
            return Stop(address, failure)
        give_up = GiveUp(tuple(self._said.items()), self._tries, now_s - self.started_s)
        deadline = self.started_s + self.ride_out_s
        if self._at + 1 < len(self.order):
            if now_s >= deadline:
                return give_up
            self._at += 1
            return Next(self.address)
        self._rounds += 1
        pause = pause_s(self._rounds, jitter)
        if now_s + pause >= deadline:
            return give_up
        self._at = 0
        return Next(self.address, pause)
