"""``tp``'s client for the metric reads of ``tuneplane.v1.Api`` (ListMetrics, QuerySeries,
GetDelivery).

Rules: the same TLS, deadline and error translation as :class:`~.api_client.ApiClient` (it is
one); replies become :mod:`tuneplane.coordinator.values.metrics` through
:mod:`tuneplane.coordinator.wire.metrics`, nowhere else.
"""

from __future__ import annotations

from tuneplane.proto import v1

from ..values.metrics import Delivery, MetricSelector, SeriesResult, TagSummary
from ..wire.metrics import delivery_from_wire, selector_to_wire, series_from_wire, tags_from_wire
from .api_client import ApiClient


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
    ) -> tuple[int, list[TagSummary]]:
        """The attempt read and its tags (raw: one per series)."""
        selector = MetricSelector(run_id, raw, attempt, member, source)
        request = v1.ListMetricsRequest(selector_to_wire(selector))
        reply = await self._call(
            "ListMetrics", lambda t: self._stub.list_metrics(request, timeout=t)
        )
        return tags_from_wire(reply, raw)

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
    ) -> SeriesResult:
        request = v1.QuerySeriesRequest(
            selector=selector_to_wire(MetricSelector(run_id, raw, attempt, member, source)),
            tag=tag,
            max_points=max_points,
        )
        reply = await self._call(
            "QuerySeries", lambda t: self._stub.query_series(request, timeout=t)
        )
        return series_from_wire(reply)

    async def delivery(self, run_id: str) -> tuple[int, list[Delivery]]:
        """The coordinator's clock (epoch ms) and each member's delivery, by attempt."""
        request = v1.GetDeliveryRequest(run_id=run_id)
        reply = await self._call(
            "GetDelivery", lambda t: self._stub.get_delivery(request, timeout=t)
        )
        return delivery_from_wire(run_id, reply)
