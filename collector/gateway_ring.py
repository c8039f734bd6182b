"""Which of its telemetry gateways the collector's next Ship goes to. Sans-IO: nothing here
reads a clock or a socket.

Theory of operation: with coordinators that share a PostgreSQL store (high availability), a
collector is given every coordinator's telemetry gateway, the leader's of the time of the
Commit first. Only the leader listens, so a call to any other fails at once (refused), and a
call to a leader that died fails as soon as its connection breaks. The shipper therefore stays
on the gateway that last accepted a call; when a call to it fails, it moves to the next one of
the list (wrapping around) and calls again at once; only when every gateway of the list failed
in a row (a whole round) does it back off, and the next round starts where the failed one did.
With one gateway every failure ends a round, which is the shipper's behaviour without
high availability.

Which gateway stores a point does not matter for exactly-once delivery: every gateway writes to
the same telemetry store, whose dedup key (source, byte offset, index per member) refuses a
point already stored through another one.
"""

from __future__ import annotations

import attrs


def _at_least_one(_: object, __: attrs.Attribute[int], size: int) -> None:
    if size < 1:
        raise ValueError(f"a collector needs at least one telemetry gateway, not {size}")


@attrs.define
class GatewayRing:
    """The position in a list of ``size`` gateways; ``current`` is the index to call next."""

    size: int = attrs.field(validator=_at_least_one)
    current: int = 0
    # Failed calls in a row since the last success or the last whole round.
    _failures: int = attrs.field(default=0, alias="failures")

    def succeeded(self) -> None:
        """The call to ``current`` was accepted: stay on it."""
        self._failures = 0

    def failed(self) -> bool:
        """The call to ``current`` failed: move to the next gateway. True when this failure
        ended a whole round (every gateway failed in a row): back off before calling again."""
        self._failures += 1
        self.current = (self.current + 1) % self.size
        if self._failures < self.size:
            return False
        self._failures = 0
        return True
