"""The pure rule for which telemetry gateway the next Ship goes to, against a plain model."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tuneplane.collector.gateway_ring import GatewayRing


@given(st.integers(min_value=1, max_value=5), st.lists(st.booleans(), max_size=60))
def test_the_ring_moves_on_each_failure_and_backs_off_only_after_a_whole_round(
    size: int, outcomes: list[bool]
) -> None:
    ring = GatewayRing(size)
    current, in_a_row = 0, 0  # the model: the gateway called next, failures since a rest
    for accepted in outcomes:
        assert ring.current == current
        if accepted:
            ring.succeeded()
            in_a_row = 0
            continue
        back_off = ring.failed()
        current = (current + 1) % size
        in_a_row += 1
        assert back_off == (in_a_row == size)
        if back_off:
            in_a_row = 0
    assert ring.current == current


def test_a_whole_round_ends_where_it_started_and_an_accepting_gateway_is_kept() -> None:
    ring = GatewayRing(3)
    assert [ring.failed(), ring.failed()] == [False, False]
    ring.succeeded()
    assert ring.current == 2  # the third gateway accepted: the shipper stays there
    assert [ring.failed(), ring.failed(), ring.failed()] == [False, False, True]
    assert ring.current == 2


def test_one_gateway_backs_off_after_every_failure() -> None:
    ring = GatewayRing(1)
    assert [ring.failed(), ring.failed()] == [True, True]
    assert ring.current == 0


def test_a_ring_needs_a_gateway() -> None:
    with pytest.raises(ValueError, match="at least one telemetry gateway"):
        GatewayRing(0)
