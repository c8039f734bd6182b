"""The telemetry gateway (``tuneplane.v1.Telemetry``), on its own listener.

Rules:
- ``Ship`` and ``Ping`` take only a collector credential (``Ship`` only for the member it was
  minted for); Node control credentials and user tokens are refused, as a credential for one
  listener is refused on the others. An operator checks the listener with
  ``tuneplane-node doctor``, which opens a TLS connection to it and needs no credential.
- Every point is checked by the collector's own rule (:mod:`tuneplane.collector.point_rules`):
  a collector is not trusted to have applied it. A bad point is refused on its own and named in
  the reply; the rest of the batch is stored in one transaction and acknowledged only once it is
  on disk, so a retried batch stores nothing twice and one bad point never blocks the others.
- Restart and hparams marks ride in the same call and the same transaction, checked by the
  same rule (:func:`~tuneplane.collector.point_rules.mark_problem`); a bad one is refused on its
  own, named like a point in ``ShipReply.refused``.
"""

from __future__ import annotations

import logging
from typing import Any

from grpclib import GRPCError
from grpclib.const import Cardinality, Handler, Status

from tuneplane.collector.point_rules import PointScreen, mark_problem, storable
from tuneplane.proto import v1

from ..auth import AuthError, PermissionDenied, bearer_token
from ..clock import now_ms
from ..counters import observe_ship
from ..offload import in_thread
from ..store.core import Store
from ..values.telemetry import (
    RefusedPoint,
    ShippedHParams,
    ShippedPoint,
    ShippedRestart,
)
from ..wire.members import member_key
from ..wire.telemetry import (
    hparams_from_wire,
    point_from_wire,
    points_from_columns,
    progress_from_wire,
    restart_from_wire,
    ship_reply_to_wire,
)
from .bounded_decode import MAX_SHIP_MARKS
from .collector_credentials import (
    CollectorCredentials,
    is_collector_credential,
)
from .status import grpc_errors

log = logging.getLogger(__name__)

MAX_POINTS_PER_SHIP = 5000
MAX_MARKS_PER_SHIP = MAX_SHIP_MARKS
# Points read and screened on the event loop; a larger batch is read in a worker thread.
INLINE_POINTS = 50


class TelemetryGateway:
    """grpclib handlers for ``tuneplane.v1.Telemetry``."""

    def __init__(self, store: Store, collectors: CollectorCredentials) -> None:
        self._store = store
        self._collectors = collectors

    def __mapping__(self) -> dict[str, Handler]:
        return {
            "/tuneplane.v1.Telemetry/Ping": Handler(
                self._ping, Cardinality.UNARY_UNARY, v1.PingRequest, v1.PingReply
            ),
            "/tuneplane.v1.Telemetry/Ship": Handler(
                self._ship, Cardinality.UNARY_UNARY, v1.ShipRequest, v1.ShipReply
            ),
        }

    async def _ping(self, stream: Any) -> None:
        with grpc_errors():
            metadata = stream.metadata.items() if stream.metadata else ()
            if not is_collector_credential(bearer_token(metadata)):
                raise AuthError(
                    "the telemetry listener answers only collector credentials (tpc_...); user "
                    "tokens and Node control credentials are refused here. To check that it is "
                    "reachable, run `tuneplane-node doctor` on a Node, which needs no credential."
                )
            principal, _ = await self._collectors.principal(metadata, now_ms())
            await stream.recv_message()
            await stream.send_message(
                v1.PingReply(
                    server_time_ms=now_ms(), principal=f"{principal.kind}:{principal.name}"
                )
            )

    async def _ship(self, stream: Any) -> None:
        with grpc_errors():
            now = now_ms()
            metadata = stream.metadata.items() if stream.metadata else ()
            principal, grant = await self._collectors.principal(metadata, now)
            request: v1.ShipRequest = await stream.recv_message()
            member = member_key(request.member)
            if member != grant.member:
                raise PermissionDenied(
                    f"this collector credential belongs to {principal.name}; it cannot ship "
                    f"points of {member.run_id}/attempt-{member.attempt}/member-"
                    f"{member.member_index}. Each member's collector uses its own credential."
                )
            # Per point, so off the event loop for a batch of more than a few points.
            if len(request.points) > INLINE_POINTS or (
                request.columns is not None and len(request.columns.values) > INLINE_POINTS * 8
            ):
                points, refused = await in_thread(_read, request, now / 1000)
            else:
                points, refused = _read(request, now / 1000)
            report = progress_from_wire(request.progress)
            restarts, hparams, refused_marks = _marks(request)
            refused += refused_marks
            result = await self._collectors.store.ship(
                member, points, report, now, restarts, hparams
            )
            observe_ship(result.stored, result.duplicates, len(refused))
            log.debug(
                "points shipped run_id=%s attempt=%d member=%d stored=%d duplicates=%d "
                "spool=%d drained=%s",
                member.run_id,
                member.attempt,
                member.member_index,
                result.stored,
                result.duplicates,
                report.spool_points,
                report.drained,
            )
            if refused:
                first = refused[0]
                log.warning(
                    "telemetry points refused run_id=%s attempt=%d member=%d count=%d "
                    "source=%s offset=%d reason=%s",
                    member.run_id,
                    member.attempt,
                    member.member_index,
                    len(refused),
                    storable(first.source_id),
                    first.offset,
                    first.reason,
                )
            await stream.send_message(ship_reply_to_wire(result, refused, now_ms()))


def _read(request: v1.ShipRequest, now_s: float) -> tuple[list[ShippedPoint], list[RefusedPoint]]:
    """The request's points (messages and columns), screened: see :func:`_screen`."""
    points = [point_from_wire(p) for p in request.points]
    if request.columns is not None and request.columns.strings:
        points += points_from_columns(request.columns)
    return _screen(points, now_s)


def _marks(
    request: v1.ShipRequest,
) -> tuple[list[ShippedRestart], list[ShippedHParams], list[RefusedPoint]]:
    """The request's restart and hparams marks that may be stored, and each other one refused
    on its own (a batch of more than :data:`MAX_MARKS_PER_SHIP` is refused whole)."""
    count = len(request.restarts) + len(request.hparams)
    if count > MAX_MARKS_PER_SHIP:
        raise GRPCError(
            Status.INVALID_ARGUMENT,
            f"ShipRequest holds {count} restart and hparams marks, more than "
            f"{MAX_MARKS_PER_SHIP}. Send smaller batches.",
        )
    restarts: list[ShippedRestart] = []
    hparams: list[ShippedHParams] = []
    refused: list[RefusedPoint] = []

    def refuse(source_id: str, offset: int, index: int, why: str, what: str) -> None:
        refused.append(
            RefusedPoint(storable(source_id), offset, index, f"{why}; the {what} is not stored")
        )

    for r in request.restarts:
        why = mark_problem(r.source_id, r.offset, r.tags)
        if why is None and r.all_tags and r.tags:
            why = "the restart mark says all tags and also names tags"
        if why is not None:
            refuse(r.source_id, r.offset, 0, why, "restart mark")
            continue
        restarts.append(restart_from_wire(r))
    for h in request.hparams:
        names = [p.name for p in h.hparams] + list(h.metrics)
        why = mark_problem(h.source_id, h.offset, names, [p.value_json for p in h.hparams])
        if why is not None:
            refuse(h.source_id, h.offset, h.index, why, "hparams record")
            continue
        hparams.append(hparams_from_wire(h))
    return restarts, hparams, refused


def _screen(
    points: list[ShippedPoint], now_s: float
) -> tuple[list[ShippedPoint], list[RefusedPoint]]:
    """The points that may be stored, and each other one refused on its own with a reason.

    A batch over the count limit is refused whole: no honest collector sends one. Anything else
    wrong is a property of one point, which the collector cannot fix by sending it again.
    """
    if len(points) > MAX_POINTS_PER_SHIP:
        raise GRPCError(
            Status.INVALID_ARGUMENT,
            f"ShipRequest holds {len(points)} points, more than {MAX_POINTS_PER_SHIP}. "
            "Send smaller batches.",
        )
    good, refused = PointScreen().partition(points, now_s)
    return good, [
        RefusedPoint(storable(p.source_id), p.offset, p.index, f"{why}; the point is not stored")
        for p, why in refused
    ]
