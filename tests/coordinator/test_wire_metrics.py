"""The Api's metric reads (coordinator/wire/metrics.py): a selector, the tags of a raw or a
canonical read, a bounded series and a Job's delivery come back equal from the wire; an unset
number stays unset, and NaN and infinities travel as they are."""

from __future__ import annotations

import math
from typing import TypeVar

import betterproto
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support import value_strategies as vs
from tuneplane.coordinator.downsample import Bucket
from tuneplane.coordinator.values.metrics import (
    Delivery,
    MetricSelector,
    SeriesResult,
    TagSummary,
)
from tuneplane.coordinator.wire.errors import BadMessage
from tuneplane.coordinator.wire.metrics import (
    delivery_from_wire,
    delivery_to_wire,
    selector_from_wire,
    selector_to_wire,
    series_from_wire,
    series_to_wire,
    tags_from_wire,
    tags_to_wire,
)
from tuneplane.proto import v1

pytestmark = pytest.mark.timeout(120)

M = TypeVar("M", bound=betterproto.Message)
RUN = "run-7"


def through_bytes(msg: M) -> M:
    return type(msg)().parse(bytes(msg))


@given(vs.selectors)
def test_a_selector_comes_back_equal(selector: MetricSelector) -> None:
    assert selector_from_wire(through_bytes(selector_to_wire(selector))) == selector


@given(st.booleans().flatmap(lambda raw: st.tuples(st.just(raw), st.lists(vs.tag_summaries(raw)))))
def test_the_tags_of_a_raw_or_canonical_read_come_back_equal(
    case: tuple[bool, list[TagSummary]],
) -> None:
    raw, tags = case
    assert tags_from_wire(through_bytes(tags_to_wire(3, tags)), raw) == (3, tags)


@given(vs.series_results)
def test_a_series_comes_back_equal(series: SeriesResult) -> None:
    assert series_from_wire(through_bytes(series_to_wire(series))) == series


@given(vs.i64, st.lists(vs.deliveries(RUN), max_size=3))
def test_a_job_s_delivery_comes_back_equal(now: int, members: list[Delivery]) -> None:
    assert delivery_from_wire(RUN, through_bytes(delivery_to_wire(now, members))) == (now, members)


def test_a_selector_without_a_run_id_is_refused() -> None:
    with pytest.raises(BadMessage, match=r"MetricSelector\.run_id is empty\. Name the Job"):
        selector_from_wire(through_bytes(v1.MetricSelector(raw=True)))


def test_member_zero_and_no_member_stay_apart() -> None:
    zero = MetricSelector(RUN, raw=True, member_index=0)
    assert selector_from_wire(through_bytes(selector_to_wire(zero))).member_index == 0
    every = MetricSelector(RUN, raw=True)
    assert selector_from_wire(through_bytes(selector_to_wire(every))).member_index is None


def test_nan_and_infinities_travel_as_they_are() -> None:
    nan, inf = math.nan, math.inf
    series = SeriesResult("loss", 1, 1, False, (Bucket(0, 0, 1, -inf, inf, nan),), 1)
    (bucket,) = series_from_wire(through_bytes(series_to_wire(series))).buckets
    assert (bucket.min, bucket.max, math.isnan(bucket.last)) == (-inf, inf, True)
    tag = TagSummary("loss", 1, None, "", 1, 0, nan, nan, 1)
    _, (read,) = tags_from_wire(through_bytes(tags_to_wire(1, [tag])), raw=False)
    assert math.isnan(read.last_value)
    assert read.last_wall_time is not None and math.isnan(read.last_wall_time)
