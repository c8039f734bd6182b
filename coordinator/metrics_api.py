"""The metric reads of ``tuneplane.v1.Api``: ListMetrics, QuerySeries, GetDelivery.

Rules:
- Registered on the Api listener beside :class:`~tuneplane.coordinator.api_service.ApiService`;
  user tokens only, and only those who may read the Job (its owner, the users its project
  shares it with, admins: :mod:`~tuneplane.coordinator.job_access`). Every answer is bounded:
  a series comes back whole only when it has at most ``max_points`` points, otherwise as at
  most that many buckets (min, max and last each).
- Reads only: nothing here touches a Job's state, and a Job's state never waits for these.
"""

from __future__ import annotations

import logging
from typing import Any

from grpclib import GRPCError
from grpclib.const import Cardinality, Handler, Status

from tuneplane.coordinator.clock import now_ms
from tuneplane.coordinator.fleet_service import caller
from tuneplane.coordinator.job_access import check_read
from tuneplane.coordinator.store import Store
from tuneplane.coordinator.store_access import job_access
from tuneplane.coordinator.store_metrics import TelemetryStore
from tuneplane.coordinator.telemetry_records import MetricSelector
from tuneplane.coordinator.wire import grpc_errors
from tuneplane.proto import v1

log = logging.getLogger(__name__)

DEFAULT_MAX_POINTS = 1000
MAX_MAX_POINTS = 10_000


def selector_from_wire(msg: v1.MetricSelector | None) -> MetricSelector:
    if msg is None or not msg.run_id:
        raise GRPCError(
            Status.INVALID_ARGUMENT, "MetricSelector.run_id is empty. Name the Job's run id."
        )
    return MetricSelector(
        run_id=msg.run_id,
        raw=msg.raw,
        attempt=msg.attempt,
        member_index=msg.member_index if msg.has_member else None,
        source=msg.source,
    )


class MetricsApi:
    """grpclib handlers for the metric RPCs of ``tuneplane.v1.Api``."""

    def __init__(self, store: Store, telemetry: TelemetryStore) -> None:
        self._store = store
        self._telemetry = telemetry

    def __mapping__(self) -> dict[str, Handler]:
        return {
            "/tuneplane.v1.Api/ListMetrics": Handler(
                self._list_metrics,
                Cardinality.UNARY_UNARY,
                v1.ListMetricsRequest,
                v1.ListMetricsReply,
            ),
            "/tuneplane.v1.Api/QuerySeries": Handler(
                self._query_series,
                Cardinality.UNARY_UNARY,
                v1.QuerySeriesRequest,
                v1.QuerySeriesReply,
            ),
            "/tuneplane.v1.Api/GetDelivery": Handler(
                self._get_delivery,
                Cardinality.UNARY_UNARY,
                v1.GetDeliveryRequest,
                v1.GetDeliveryReply,
            ),
        }

    async def _list_metrics(self, stream: Any) -> None:
        with grpc_errors():
            user = await caller(self._store, stream)
            request: v1.ListMetricsRequest = await stream.recv_message()
            selector = selector_from_wire(request.selector)
            check_read(await job_access(self._store, selector.run_id), user, "metrics")
            attempt, tags = await self._telemetry.list_tags(selector)
            await stream.send_message(
                v1.ListMetricsReply(
                    attempt=attempt,
                    tags=[
                        v1.MetricTag(
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
                        for t in tags
                    ],
                )
            )

    async def _query_series(self, stream: Any) -> None:
        with grpc_errors():
            user = await caller(self._store, stream)
            request: v1.QuerySeriesRequest = await stream.recv_message()
            selector = selector_from_wire(request.selector)
            if not request.tag:
                raise GRPCError(
                    Status.INVALID_ARGUMENT,
                    "QuerySeriesRequest.tag is empty. Name a tag (`tp metrics RUN_ID` lists them).",
                )
            max_points = request.max_points or DEFAULT_MAX_POINTS
            if max_points > MAX_MAX_POINTS:
                raise GRPCError(
                    Status.INVALID_ARGUMENT,
                    f"QuerySeriesRequest.max_points is {max_points}, more than {MAX_MAX_POINTS}. "
                    "Ask for fewer points; buckets keep each interval's min, max and last.",
                )
            check_read(await job_access(self._store, selector.run_id), user, "metrics")
            result = await self._telemetry.query_series(selector, request.tag, max_points)
            await stream.send_message(
                v1.QuerySeriesReply(
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
            )

    async def _get_delivery(self, stream: Any) -> None:
        with grpc_errors():
            user = await caller(self._store, stream)
            request: v1.GetDeliveryRequest = await stream.recv_message()
            if not request.run_id:
                raise GRPCError(
                    Status.INVALID_ARGUMENT, "GetDeliveryRequest.run_id is empty. Name a run id."
                )
            check_read(await job_access(self._store, request.run_id), user, "metrics")
            members = await self._telemetry.delivery(request.run_id)
            await stream.send_message(
                v1.GetDeliveryReply(
                    server_time_ms=now_ms(),
                    members=[
                        v1.MemberDelivery(
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
                        for d in members
                    ],
                )
            )
