"""The Api's metric reads (ListMetrics, QuerySeries, GetDelivery): their messages to and from
:mod:`..values.metrics`.

Rules: the metric handlers write with ``*_to_wire`` and ``tp``'s client reads with
``*_from_wire``. The wire has no "unset" for a number, so an optional one travels with a
``has_*`` flag (a selector's member, a tag's last wall time, a member's last point); a tag's
member index means something only in the raw view, and a delivery names its Job once, in the
request. NaN and infinities travel as they are.
"""

from __future__ import annotations

from tuneplane.proto import v1

from ..downsample import Bucket
from ..values.jobs import MemberKey
from ..values.metrics import Delivery, MetricSelector, RunHParams, SeriesResult, TagSummary
from .errors import BadMessage


def selector_to_wire(selector: MetricSelector) -> v1.MetricSelector:
    return v1.MetricSelector(
        run_id=selector.run_id,
        raw=selector.raw,
        attempt=selector.attempt,
        has_member=selector.member_index is not None,
        member_index=selector.member_index or 0,
        source=selector.source,
    )


def selector_from_wire(msg: v1.MetricSelector | None) -> MetricSelector:
    if msg is None or not msg.run_id:
        raise BadMessage("MetricSelector.run_id is empty. Name the Job's run id.")
    return MetricSelector(
        run_id=msg.run_id,
        raw=msg.raw,
        attempt=msg.attempt,
        member_index=msg.member_index if msg.has_member else None,
        source=msg.source,
    )


def tag_to_wire(t: TagSummary) -> v1.MetricTag:
    return v1.MetricTag(
        tag=t.tag,
        attempt=t.attempt,
        member_index=t.member_index or 0,
        source=t.source,
        points=t.points,
        last_step=t.last_step,
        last_value=t.last_value,
        has_last_wall_time=t.last_wall_time is not None,
        last_wall_time=t.last_wall_time or 0.0,
        series=t.series,
    )


def tag_from_wire(m: v1.MetricTag, raw: bool) -> TagSummary:
    """One tag of a ListMetrics reply to a ``raw`` (or canonical) selector."""
    return TagSummary(
        tag=m.tag,
        attempt=m.attempt,
        member_index=m.member_index if raw else None,
        source=m.source,
        points=m.points,
        last_step=m.last_step,
        last_value=m.last_value,
        last_wall_time=m.last_wall_time if m.has_last_wall_time else None,
        series=m.series,
    )


def tags_to_wire(attempt: int, tags: list[TagSummary]) -> v1.ListMetricsReply:
    return v1.ListMetricsReply(attempt=attempt, tags=[tag_to_wire(t) for t in tags])


def tags_from_wire(reply: v1.ListMetricsReply, raw: bool) -> tuple[int, list[TagSummary]]:
    """The attempt the reply read and its tags."""
    return reply.attempt, [tag_from_wire(m, raw) for m in reply.tags]


def series_to_wire(result: SeriesResult) -> v1.QuerySeriesReply:
    return v1.QuerySeriesReply(
        tag=result.tag,
        attempt=result.attempt,
        total_points=result.total_points,
        downsampled=result.downsampled,
        series=result.series,
        buckets=[
            v1.SeriesBucket(
                first_step=b.first_step,
                last_step=b.last_step,
                count=b.count,
                min=b.min,
                max=b.max,
                last=b.last,
            )
            for b in result.buckets
        ],
    )


def series_from_wire(r: v1.QuerySeriesReply) -> SeriesResult:
    return SeriesResult(
        tag=r.tag,
        attempt=r.attempt,
        total_points=r.total_points,
        downsampled=r.downsampled,
        buckets=tuple(
            Bucket(b.first_step, b.last_step, b.count, b.min, b.max, b.last) for b in r.buckets
        ),
        series=r.series,
    )


def _delivery_to_wire(d: Delivery) -> v1.MemberDelivery:
    return v1.MemberDelivery(
        attempt=d.member.attempt,
        member_index=d.member.member_index,
        points_stored=d.points_stored,
        spool_points=d.spool_points,
        backpressure=d.backpressure,
        drained=d.drained,
        has_last_point=d.last_point_wall_ms is not None,
        last_point_wall_ms=d.last_point_wall_ms or 0,
        last_contact_ms=d.last_contact_ms,
        warnings=d.warnings,
        data_loss_warnings=d.data_loss_warnings,
        hparams=[
            v1.RunHParams(
                source=h.source,
                hparams=[v1.HParam(name=n, value_json=v) for n, v in h.hparams],
                metrics=list(h.metrics),
            )
            for h in d.hparams
        ],
        orphaned_points=d.orphaned_points,
    )


def _delivery_from_wire(run_id: str, d: v1.MemberDelivery) -> Delivery:
    return Delivery(
        member=MemberKey(run_id, d.attempt, d.member_index),
        points_stored=d.points_stored,
        spool_points=d.spool_points,
        backpressure=d.backpressure,
        drained=d.drained,
        last_point_wall_ms=d.last_point_wall_ms if d.has_last_point else None,
        last_contact_ms=d.last_contact_ms,
        warnings=d.warnings,
        data_loss_warnings=d.data_loss_warnings,
        hparams=tuple(
            RunHParams(h.source, tuple((p.name, p.value_json) for p in h.hparams), tuple(h.metrics))
            for h in d.hparams
        ),
        orphaned_points=d.orphaned_points,
    )


def delivery_to_wire(server_time_ms: int, members: list[Delivery]) -> v1.GetDeliveryReply:
    """The GetDelivery reply: the coordinator's clock and each member's delivery (all of one
    Job)."""
    return v1.GetDeliveryReply(
        server_time_ms=server_time_ms, members=[_delivery_to_wire(d) for d in members]
    )


def delivery_from_wire(run_id: str, r: v1.GetDeliveryReply) -> tuple[int, list[Delivery]]:
    """The coordinator's clock (epoch ms) and each member of Job ``run_id``'s delivery."""
    return r.server_time_ms, [_delivery_from_wire(run_id, d) for d in r.members]
