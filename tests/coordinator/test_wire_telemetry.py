"""The collector boundary (coordinator/wire/telemetry.py): a shipped point, restart mark, hparams
mark and progress report, a refusal and a Ship's reply come back equal from the wire; the
point columns the collector writes are read back point for point; columns that do not add up
are refused with a sentence."""

from __future__ import annotations

from typing import TypeVar

import betterproto
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support import value_strategies as vs
from tuneplane.collector.ship_wire import columns
from tuneplane.collector.spool import SpooledPoint
from tuneplane.coordinator.values.telemetry import (
    CollectorReport,
    RefusedPoint,
    ShippedHParams,
    ShippedPoint,
    ShippedRestart,
    ShipResult,
)
from tuneplane.coordinator.wire.errors import BadMessage
from tuneplane.coordinator.wire.telemetry import (
    hparams_from_wire,
    hparams_to_wire,
    point_from_wire,
    point_to_wire,
    points_from_columns,
    progress_from_wire,
    progress_to_wire,
    restart_from_wire,
    restart_to_wire,
    ship_reply_from_wire,
    ship_reply_to_wire,
)
from tuneplane.proto import v1

pytestmark = pytest.mark.timeout(120)

M = TypeVar("M", bound=betterproto.Message)


def through_bytes(msg: M) -> M:
    return type(msg)().parse(bytes(msg))


@given(vs.shipped_points)
def test_a_point_comes_back_equal(point: ShippedPoint) -> None:
    assert point_from_wire(through_bytes(point_to_wire(point))) == point


@given(vs.shipped_restarts)
def test_a_restart_mark_comes_back_equal(restart: ShippedRestart) -> None:
    assert restart_from_wire(through_bytes(restart_to_wire(restart))) == restart


@given(vs.shipped_hparams)
def test_an_hparams_mark_comes_back_equal(hparams: ShippedHParams) -> None:
    assert hparams_from_wire(through_bytes(hparams_to_wire(hparams))) == hparams


@given(vs.collector_reports)
def test_a_progress_report_comes_back_equal(report: CollectorReport) -> None:
    assert progress_from_wire(through_bytes(progress_to_wire(report))) == report


@given(vs.ship_results, st.lists(vs.refused_points, max_size=3), vs.i64)
def test_a_ship_reply_comes_back_equal(
    result: ShipResult, refused: list[RefusedPoint], now: int
) -> None:
    reply = through_bytes(ship_reply_to_wire(result, refused, now))
    assert ship_reply_from_wire(reply) == (result, refused)
    assert reply.server_time_ms == now


@given(st.lists(vs.shipped_points, max_size=6))
def test_the_columns_a_collector_writes_are_read_point_for_point(
    points: list[ShippedPoint],
) -> None:
    spooled = [
        SpooledPoint(i, p.source_id, p.offset, p.index, p.tag, p.step, p.wall_time, p.value)
        for i, p in enumerate(points)
    ]
    assert points_from_columns(through_bytes(columns(spooled))) == points


def test_a_ship_without_progress_reads_as_nothing_reported() -> None:
    assert progress_from_wire(through_bytes(v1.ShipRequest()).progress) == CollectorReport()


def test_a_column_that_does_not_hold_one_entry_per_point_is_refused() -> None:
    point = SpooledPoint(1, "events.out", 0, 0, "loss", 1, None, 0.5)
    short = columns([point])
    short.steps = short.steps[:4]
    with pytest.raises(BadMessage, match=r"PointColumns\.steps holds 4 bytes; 1 points need 8\."):
        points_from_columns(through_bytes(short))


def test_a_reference_past_the_strings_is_refused() -> None:
    point = SpooledPoint(1, "events.out", 0, 0, "loss", 1, None, 0.5)
    lying = columns([point])
    lying.strings = lying.strings[:1]
    with pytest.raises(BadMessage, match=r"refers to string 1, but it holds 1\."):
        points_from_columns(through_bytes(lying))
