"""When a Node dials the coordinator again (sans-IO): the wait between rounds, and the probe
that cuts it short when a coordinator comes back.

Rules (docs/operator.md, "How a Node reconnects"):
- A round dials every address of the dial order (:func:`.control_address.dial_order`), the
  next one at once after a failed one; only after a whole round failed does the Node wait.
- The wait is fully jittered (uniform in ``[0, ceiling)``), the ceiling doubling from
  :data:`BACKOFF_FIRST_S` per failed round up to a cap taken from the heartbeat timeout the
  last Welcome gave (:func:`backoff_cap`), so a Fleet that lost its coordinator together spreads
  its returns over the whole window instead of coming back in lockstep.
- A coordinator that refused the Connect as busy and named the Node's turn
  (coordinator/hello_gate.py) is dialed again then (:func:`redial_delay`), give or take
  :data:`TURN_JITTER`, whatever the backoff says: the turns it hands out are spaced at the rate
  it welcomes Nodes, so a Fleet told them comes back at that rate instead of all within the
  backoff window (most of which it would refuse again).
- While it waits, the Node probes every address with a plain TCP connect, closed at once,
  every :func:`probe_delay` (about :data:`PROBE_INTERVAL_S`, jittered). An address a probe saw
  refusing that then accepts ends the wait and is dialed first (:class:`ProbeWatch`): a
  coordinator back after a restart, or a standby that took over (standbys refuse connections
  until they lead). An address that accepted all along (it refused the session, not the
  connection) never ends a wait and is not probed again in it: only the backoff paces a
  coordinator that says no.

Nothing here reads a clock or a socket: jitter (uniform in ``[0, 1)``) and probe results are
passed in.
"""

from __future__ import annotations

import attrs

from tuneplane.proto.contract.control_protocol import QUEUED_CAP_S

#: The ceiling of the first wait; it doubles per failed round up to the cap.
BACKOFF_FIRST_S = 0.5
#: The heartbeat timeout assumed before any Welcome stated one (the coordinator's default).
DEFAULT_HEARTBEAT_TIMEOUT_S = 15.0
#: The cap never goes below this (a coordinator with a tiny timeout does not make its Fleet
#: dial in a busy loop) nor above :data:`CAP_CEILING_S` (nor does a huge one strand it).
CAP_FLOOR_S = 1.0
CAP_CEILING_S = 30.0
#: About how often a waiting Node probes each address, and how long one probe may take.
PROBE_INTERVAL_S = 0.5
PROBE_TIMEOUT_S = 1.0


def backoff_cap(heartbeat_timeout_s: float | None) -> float:
    """The longest wait between two rounds: a third of the heartbeat timeout the last Welcome
    gave (:data:`DEFAULT_HEARTBEAT_TIMEOUT_S` when none did), within
    [:data:`CAP_FLOOR_S`, :data:`CAP_CEILING_S`].

    Why a third of the timeout, not the heartbeat interval: the timeout is how long the
    coordinator tolerates a silent Node before its Jobs read ``unknown``, so a Node that dials
    at least three times per timeout is back within about one timeout of the coordinator's
    return even when no probe could tell (the port accepted all along). The interval is a
    measurement setting an operator may shrink for finer round-trip times without meaning to
    speed up a whole Fleet's reconnects. With the defaults (5 s interval, 15 s timeout) the two
    agree: 5 s.
    """
    timeout = DEFAULT_HEARTBEAT_TIMEOUT_S if heartbeat_timeout_s is None else heartbeat_timeout_s
    return min(CAP_CEILING_S, max(CAP_FLOOR_S, timeout / 3))


def backoff_delay(failed_rounds: int, jitter: float, cap: float) -> float:
    """Seconds to wait after ``failed_rounds`` (1, 2, ...) whole rounds failed in a row.

    Full jitter: ``jitter`` (uniform in [0, 1)) scales the whole window, whose ceiling doubles
    from :data:`BACKOFF_FIRST_S` per round up to ``cap``. No wait before the first round.
    """
    if failed_rounds < 1:
        return 0.0
    ceiling = min(cap, BACKOFF_FIRST_S * float(2 ** min(failed_rounds - 1, 16)))
    return ceiling * min(max(jitter, 0.0), 1.0)


#: A named turn is kept within this fraction of itself, either way.
TURN_JITTER = 0.1


def redial_delay(failed_rounds: int, jitter: float, cap: float, come_back_s: float | None) -> float:
    """Seconds to wait before the next round: the turn a busy coordinator named this round
    (``come_back_s``), scaled into [0.9, 1.1) of itself by ``jitter``; without one, the
    backoff (:func:`backoff_delay`)."""
    if come_back_s is None:
        return backoff_delay(failed_rounds, jitter, cap)
    spread = 1 - TURN_JITTER + 2 * TURN_JITTER * min(max(jitter, 0.0), 1.0)
    return max(come_back_s, 0.0) * spread


def probe_delay(jitter: float) -> float:
    """Seconds until the next probe: :data:`PROBE_INTERVAL_S` scaled into [0.5, 1.5) of itself
    by ``jitter`` (uniform in [0, 1)), so Nodes that lost the coordinator together do not
    probe, nor come back, in step."""
    return PROBE_INTERVAL_S * (0.5 + min(max(jitter, 0.0), 1.0))


@attrs.define
class ProbeWatch:
    """What one wait's probes saw: the addresses that refused a TCP connect, and those that
    accepted one without having refused first (they refuse the session, not the connection:
    probing them again would only load a coordinator that is saying no, so they are not)."""

    refusing: set[str] = attrs.field(factory=set)
    accepting: set[str] = attrs.field(factory=set)

    def to_probe(self, addresses: tuple[str, ...]) -> tuple[str, ...]:
        """The addresses the next sweep probes: all but those seen accepting all along."""
        return tuple(a for a in addresses if a not in self.accepting)

    def observe(self, results: dict[str, bool]) -> str | None:
        """Record one sweep (address -> accepted), in dial order; the first address that a
        probe saw refusing and that now accepts, or None."""
        back: str | None = None
        for address, accepted in results.items():
            if not accepted:
                self.refusing.add(address)
            elif address in self.refusing:
                back = back or address
            else:
                self.accepting.add(address)
        return back


def welcome_timeout_in_line(wait_s: float, usual_s: float) -> float:
    """How long a Node a coordinator put in line (``wait_s``: the wait it expects) awaits its
    Welcome: twice that plus the ``usual_s`` Welcome timeout, at most
    :data:`~tuneplane.proto.contract.control_protocol.QUEUED_CAP_S`. A coordinator that misjudged
    its rate is not given up on at once, nor waited for forever."""
    return min(2 * wait_s + usual_s, QUEUED_CAP_S)
