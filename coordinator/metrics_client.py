"""``tp``'s client for the metric reads of ``tuneplane.v1.Api`` (ListMetrics, QuerySeries,
GetDelivery).

Rules: the same TLS, deadline and error translation as :class:`ApiClient` (it is one); wire
messages become :mod:`~tuneplane.coordinator.metricsmodel` values here, nowhere else.
"""

from __future__ import annotations

from tuneplane.coordinator.apiclient import ApiClient
from tuneplane.coordinator.metricsmodel import (
    BucketView,
    DeliveryView,
    HParamsView,
    MetricTagView,
    SeriesView,
)
from tuneplane.proto import v1


def _selector(
    run_id: str, raw: bool, attempt: int, member: int | None, source: str
) -> v1.MetricSelector:
    return v1.MetricSelector(
        run_id=run_id,
        raw=raw,
        attempt=attempt,
        has_member=member is not None,
        member_index=member or 0,
        source=source,
    )


class MetricsClient(ApiClient):
    """Use as ``async with MetricsClient(endpoint) as api: await api.list_metrics(...)``."""

    async def list_metrics(
        self,
        run_id: str,
        *,
        raw: bool = False,
        attempt: int = 0,
        member: int | None = None,
        source: str = "",
    ) -> tuple[int, list[MetricTagView]]:
        request = v1.ListMetricsRequest(_selector(run_id, raw, attempt, member, source))
        reply = await self._call(
            "ListMetrics", lambda t: self._stub.list_metrics(request, timeout=t)
        )
        return reply.attempt, [
            MetricTagView(
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
            for m in reply.tags
        ]

    async def query_series(
        self,
        run_id: str,
        tag: str,
        max_points: int,
        *,
        raw: bool = False,
        attempt: int = 0,
        member: int | None = None,
        source: str = "",
    ) -> SeriesView:
        request = v1.QuerySeriesRequest(
            selector=_selector(run_id, raw, attempt, member, source),
            tag=tag,
            max_points=max_points,
        )
        r = await self._call("QuerySeries", lambda t: self._stub.query_series(request, timeout=t))
        return SeriesView(
            tag=r.tag,
            attempt=r.attempt,
            total_points=r.total_points,
            downsampled=r.downsampled,
            series=r.series,
            buckets=tuple(
                BucketView(b.first_step, b.last_step, b.count, b.min, b.max, b.last)
                for b in r.buckets
            ),
        )

    async def delivery(self, run_id: str) -> tuple[int, list[DeliveryView]]:
        """The coordinator's clock (epoch ms) and each member's delivery, by attempt."""
        request = v1.GetDeliveryRequest(run_id=run_id)
        r = await self._call("GetDelivery", lambda t: self._stub.get_delivery(request, timeout=t))
        return r.server_time_ms, [
            DeliveryView(
                attempt=d.attempt,
                member_index=d.member_index,
                points_stored=d.points_stored,
                spool_points=d.spool_points,
                backpressure=d.backpressure,
                drained=d.drained,
                last_point_wall_ms=d.last_point_wall_ms if d.has_last_point else None,
                last_contact_ms=d.last_contact_ms,
                warnings=d.warnings,
                data_loss_warnings=d.data_loss_warnings,
                hparams=tuple(
                    HParamsView(
                        h.source,
                        tuple((p.name, p.value_json) for p in h.hparams),
                        tuple(h.metrics),
                    )
                    for h in d.hparams
                ),
                orphaned_points=d.orphaned_points,
            )
            for d in r.members
        ]
