"""Per-peer token buckets for calls anyone can make before authenticating (``Enroll``).

Rules: pure; the caller passes ``now`` (seconds, any monotonic origin) and reads back how long to
wait. A peer is its address without the port. The table of peers is bounded: when it is full the
peer heard from least recently is forgotten (a forgotten peer starts with a full bucket, so the
bound costs an attacker's many addresses nothing they did not already have).
"""

from __future__ import annotations

from collections import OrderedDict

import attrs

MAX_PEERS = 10_000


@attrs.define
class TokenBucket:
    """``burst`` calls at once, then ``per_second`` on average."""

    burst: float
    per_second: float
    tokens: float
    updated: float

    @classmethod
    def full(cls, burst: float, per_second: float, now: float) -> TokenBucket:
        return cls(burst, per_second, burst, now)

    def take(self, now: float) -> float:
        """Spend a token: 0.0 if allowed, else the seconds until one is available."""
        elapsed = max(0.0, now - self.updated)
        self.tokens = min(self.burst, self.tokens + elapsed * self.per_second)
        self.updated = max(self.updated, now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        if self.per_second <= 0:
            return float("inf")
        return (1.0 - self.tokens) / self.per_second


@attrs.define
class PeerRateLimit:
    """One :class:`TokenBucket` per peer; ``burst <= 0`` turns the limit off."""

    burst: float
    per_second: float
    max_peers: int = MAX_PEERS
    _buckets: OrderedDict[str, TokenBucket] = attrs.field(factory=OrderedDict, alias="_buckets")

    def take(self, peer: str, now: float) -> float:
        """0.0 if ``peer`` may call now, else the seconds it should wait."""
        if self.burst <= 0:
            return 0.0
        bucket = self._buckets.get(peer)
        if bucket is None:
            bucket = TokenBucket.full(self.burst, self.per_second, now)
            self._buckets[peer] = bucket
            while len(self._buckets) > self.max_peers:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(peer)
        return bucket.take(now)

    def __len__(self) -> int:
        return len(self._buckets)


def peer_host(addr: object) -> str:
    """The host part of a grpclib ``peer.addr()`` (``(host, port, ...)`` or None)."""
    if isinstance(addr, tuple) and addr:
        return str(addr[0])
    return "unknown"
