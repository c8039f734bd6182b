"""The metric reads of ``tuneplane.v1.Api``: ListMetrics, QuerySeries, GetDelivery.

Rules:
- Registered on the Api listener beside :class:`~tuneplane.coordinator.api.jobs.ApiService`;
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

from tuneplane.proto import v1

from ..clock import now_ms
from ..gateways.status import grpc_errors
from ..job_access import check_read
from ..store.access import job_access
from ..store.core import Store
from ..store.telemetry import TelemetryStore
from ..wire.metrics import (
    delivery_to_wire,
    selector_from_wire,
    series_to_wire,
    tags_to_wire,
)
from .fleet import caller

log = logging.getLogger(__name__)

DEFAULT_MAX_POINTS = 1000
MAX_MAX_POINTS = 10_000


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
            await stream.send_message(tags_to_wire(attempt, tags))

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
            await stream.send_message(series_to_wire(result))

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
            await stream.send_message(delivery_to_wire(now_ms(), members))
