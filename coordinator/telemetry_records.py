"""Domain values of the telemetry side: collector grants, shipped points, metric reads.

Rules: frozen attrs values only, no betterproto type (the gateway and the metrics API convert at
the wire edge). Wall times are float seconds since the epoch, as the sources write them; a value
of NaN is stored as SQL NULL and comes back as NaN.
"""

from __future__ import annotations

import attrs

from tuneplane.coordinator.downsample import Bucket
from tuneplane.coordinator.records import MemberKey


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
    """A restart mark as a collector shipped it (:mod:`tuneplane.coordinator.orphans`);
    ``tags`` None: every tag."""

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
class RunHParams:
    """What one source recorded: the first value of each hparam name, and metric names."""

    source: str
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
    stored: int
    duplicates: int


@attrs.frozen
class MetricSelector:
    """Which series a read covers. ``attempt`` 0 is the latest attempt that has points."""

    run_id: str
    raw: bool = False
    attempt: int = 0
    member_index: int | None = None
    source: str = ""


@attrs.frozen
class TagSummary:
    """One tag (canonical) or one series (raw): its point count and newest value."""

    tag: str
    attempt: int
    member_index: int | None
    source: str
    points: int
    last_step: int
    last_value: float
    last_wall_time: float | None
    series: int


@attrs.frozen
class SeriesResult:
    tag: str
    attempt: int
    total_points: int
    downsampled: bool
    buckets: tuple[Bucket, ...]
    series: int


@attrs.frozen
class Delivery:
    """How far one member's telemetry reached the store, as of its collector's last call."""

    member: MemberKey
    points_stored: int
    spool_points: int
    backpressure: bool
    drained: bool
    last_point_wall_ms: int | None
    last_contact_ms: int
    warnings: int
    data_loss_warnings: int
    hparams: tuple[RunHParams, ...] = ()
    orphaned_points: int = 0
