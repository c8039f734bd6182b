"""What ``tp metrics`` gets back, as attrs values: tags, bounded series, delivery per member.

Rules: nothing here imports grpclib or betterproto (``tp`` starts fast); field names follow the
Api messages, so ``--json`` output reads like the protocol. NaN and infinities are kept.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class MetricTagView:
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
class BucketView:
    first_step: int
    last_step: int
    count: int
    min: float
    max: float
    last: float


@attrs.frozen
class SeriesView:
    tag: str
    attempt: int
    total_points: int
    downsampled: bool
    series: int
    buckets: tuple[BucketView, ...]


@attrs.frozen
class HParamsView:
    """One run's hparams (name -> value as JSON text, first value wins) and metric names."""

    source: str
    hparams: tuple[tuple[str, str], ...]
    metrics: tuple[str, ...]


@attrs.frozen
class DeliveryView:
    attempt: int
    member_index: int
    points_stored: int
    spool_points: int
    backpressure: bool
    drained: bool
    last_point_wall_ms: int | None
    last_contact_ms: int
    warnings: int
    data_loss_warnings: int
    hparams: tuple[HParamsView, ...] = ()
    orphaned_points: int = 0
