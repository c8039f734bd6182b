"""What collectors ship and what their credentials allow: the telemetry gateway's values.

Rules: frozen attrs values only (see :mod:`..values`); :mod:`..wire.telemetry` converts them to
and from the Telemetry service's messages. Wall times are float seconds since the epoch, as the
sources write them; None when a source wrote none.
"""

from __future__ import annotations

import attrs

from .jobs import MemberKey


@attrs.frozen
class CollectorGrant:
    """What a collector credential allows: shipping the points of ``member`` until expiry."""

    member: MemberKey
    node_id: str
    issued_at_ms: int
    expires_at_ms: int
    ended_at_ms: int | None


@attrs.frozen(slots=True)
class ShippedPoint:
    """One point as a collector shipped it; ``(source_id, offset, index)`` is its dedup key."""

    source_id: str
    offset: int
    index: int
    tag: str
    step: int
    wall_time: float | None
    value: float


@attrs.frozen(slots=True)
class ShippedRestart:
    """A restart mark as a collector shipped it (:mod:`..orphans`); ``tags`` None: every tag."""

    source_id: str
    offset: int
    step: int
    tags: tuple[str, ...] | None
    wall_time: float | None


@attrs.frozen(slots=True)
class ShippedHParams:
    """A run's hparams (name, value as JSON text) and metric names, as a collector shipped
    them; ``(source_id, offset, index)`` is its dedup key."""

    source_id: str
    offset: int
    index: int
    hparams: tuple[tuple[str, str], ...]
    metrics: tuple[str, ...]


@attrs.frozen
class CollectorReport:
    """The collector's own account of itself, sent with every Ship."""

    spool_points: int = 0
    backpressure: bool = False
    member_exited: bool = False
    drained: bool = False
    warnings: int = 0
    data_loss_warnings: int = 0


@attrs.frozen
class ShipResult:
    """What the store did with a Ship's points: stored now, or already stored before."""

    stored: int
    duplicates: int


@attrs.frozen
class RefusedPoint:
    """A point or mark the gateway would not store, and why (a sentence); the collector records
    it as a data-loss warning and never sends it again."""

    source_id: str
    offset: int
    index: int
    reason: str
