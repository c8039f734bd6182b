"""The collector boundary (``tuneplane.v1.Telemetry``): a Ship's points, marks and progress to
and from :mod:`..values.telemetry`, and the reply that names what was refused.

Rules: the telemetry gateway converts here and nowhere else; screening a point or a mark is the
gateway's job (:mod:`tuneplane.collector.point_rules`), not this module's. A number the wire
cannot leave unset travels with a ``has_*`` flag; a point column that does not hold one entry
per point, or a reference past the column's strings, is a :class:`~.errors.BadMessage`. Point
columns are written by the collector (:func:`tuneplane.collector.ship_wire.columns`) and read
here.
"""

from __future__ import annotations

import math
import sys
from array import array
from typing import Any

from tuneplane.proto import v1

from ..values.telemetry import (
    CollectorReport,
    RefusedPoint,
    ShippedHParams,
    ShippedPoint,
    ShippedRestart,
    ShipResult,
)
from .errors import BadMessage


def point_from_wire(p: v1.MetricPoint) -> ShippedPoint:
    return ShippedPoint(
        source_id=p.source_id,
        offset=p.offset,
        index=p.index,
        tag=p.tag,
        step=p.step,
        wall_time=p.wall_time if p.has_wall_time else None,
        value=p.value,
    )


def point_to_wire(p: ShippedPoint) -> v1.MetricPoint:
    return v1.MetricPoint(
        source_id=p.source_id,
        offset=p.offset,
        index=p.index,
        tag=p.tag,
        step=p.step,
        has_wall_time=p.wall_time is not None,
        wall_time=0.0 if p.wall_time is None else p.wall_time,
        value=p.value,
    )


def _column(name: str, data: bytes, typecode: str, count: int) -> list[Any]:
    column = array(typecode)
    if len(data) != count * column.itemsize:
        raise BadMessage(
            f"PointColumns.{name} holds {len(data)} bytes; {count} points need "
            f"{count * column.itemsize}. Every column has one entry per point."
        )
    column.frombytes(data)
    if sys.byteorder == "big":
        column.byteswap()
    return column.tolist()


def points_from_columns(c: v1.PointColumns) -> list[ShippedPoint]:
    """The points of ``PointColumns``: one little-endian number per point in each column, a
    wall time of NaN for none."""
    count = len(c.values) // 8
    values = _column("values", c.values, "d", count)
    sources = _column("source_refs", c.source_refs, "I", count)
    tags = _column("tag_refs", c.tag_refs, "I", count)
    offsets = _column("offsets", c.offsets, "Q", count)
    indexes = _column("indexes", c.indexes, "I", count)
    steps = _column("steps", c.steps, "q", count)
    walls = _column("wall_times", c.wall_times, "d", count)
    strings = list(c.strings)
    if count and max(max(sources), max(tags)) >= len(strings):
        raise BadMessage(
            f"PointColumns refers to string {max(max(sources), max(tags))}, but it holds "
            f"{len(strings)}. Refs index PointColumns.strings."
        )
    return [
        ShippedPoint(
            strings[sources[i]],
            offsets[i],
            indexes[i],
            strings[tags[i]],
            steps[i],
            None if math.isnan(walls[i]) else walls[i],
            values[i],
        )
        for i in range(count)
    ]


def restart_from_wire(r: v1.RestartMark) -> ShippedRestart:
    return ShippedRestart(
        r.source_id,
        r.offset,
        r.step,
        None if r.all_tags else tuple(r.tags),
        r.wall_time if r.has_wall_time else None,
    )


def restart_to_wire(r: ShippedRestart) -> v1.RestartMark:
    return v1.RestartMark(
        source_id=r.source_id,
        offset=r.offset,
        step=r.step,
        all_tags=r.tags is None,
        tags=list(r.tags or ()),
        has_wall_time=r.wall_time is not None,
        wall_time=0.0 if r.wall_time is None else r.wall_time,
    )


def hparams_from_wire(h: v1.HParamsMark) -> ShippedHParams:
    return ShippedHParams(
        h.source_id,
        h.offset,
        h.index,
        tuple((p.name, p.value_json) for p in h.hparams),
        tuple(h.metrics),
    )


def hparams_to_wire(h: ShippedHParams) -> v1.HParamsMark:
    return v1.HParamsMark(
        source_id=h.source_id,
        offset=h.offset,
        index=h.index,
        hparams=[v1.HParam(name=n, value_json=v) for n, v in h.hparams],
        metrics=list(h.metrics),
    )


def progress_from_wire(p: v1.CollectorProgress | None) -> CollectorReport:
    """The collector's account of itself; all zeros when a Ship carries none."""
    p = p or v1.CollectorProgress()
    return CollectorReport(
        spool_points=p.spool_points,
        backpressure=p.backpressure,
        member_exited=p.member_exited,
        drained=p.drained,
        warnings=p.warnings,
        data_loss_warnings=p.data_loss_warnings,
    )


def progress_to_wire(r: CollectorReport) -> v1.CollectorProgress:
    return v1.CollectorProgress(
        spool_points=r.spool_points,
        backpressure=r.backpressure,
        member_exited=r.member_exited,
        drained=r.drained,
        warnings=r.warnings,
        data_loss_warnings=r.data_loss_warnings,
    )


def refused_to_wire(r: RefusedPoint) -> v1.RefusedPoint:
    return v1.RefusedPoint(source_id=r.source_id, offset=r.offset, index=r.index, reason=r.reason)


def refused_from_wire(r: v1.RefusedPoint) -> RefusedPoint:
    return RefusedPoint(r.source_id, r.offset, r.index, r.reason)


def ship_reply_to_wire(
    result: ShipResult, refused: list[RefusedPoint], server_time_ms: int
) -> v1.ShipReply:
    return v1.ShipReply(
        stored=result.stored,
        duplicates=result.duplicates,
        server_time_ms=server_time_ms,
        refused=[refused_to_wire(r) for r in refused],
    )


def ship_reply_from_wire(reply: v1.ShipReply) -> tuple[ShipResult, list[RefusedPoint]]:
    """What the store did with a Ship's points, and what the gateway refused."""
    return (
        ShipResult(reply.stored, reply.duplicates),
        [refused_from_wire(r) for r in reply.refused],
    )
