"""Metric reads as the store answers them and ``tp metrics`` shows them: which series a read
covers, each tag's summary, a bounded series, and how far each member's telemetry arrived.

Rules: frozen attrs values only (see :mod:`..values`). Wall times are float seconds since the
epoch, as the sources write them; NaN and infinities are kept. A series' buckets are
:class:`~..downsample.Bucket` values, from the pure module that makes them.
"""

from __future__ import annotations

import attrs

from ..downsample import Bucket
from .jobs import MemberKey


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
    """One tag (canonical) or one series (raw): its point count and newest value.
    ``member_index`` is None in the canonical view, which merges every member."""

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
    """A series read with at most ``max_points`` buckets: whole when it fits (one bucket per
    point), else ``downsampled``; ``series`` counts the series merged into it."""

    tag: str
    attempt: int
    total_points: int
    downsampled: bool
    buckets: tuple[Bucket, ...]
    series: int


@attrs.frozen
class RunHParams:
    """What one source recorded: the first value of each hparam name (as JSON text), and
    metric names."""

    source: str
    hparams: tuple[tuple[str, str], ...]
    metrics: tuple[str, ...]


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
