"""The one rule for which points may be shipped, and the JSONL reader under hostile bytes."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from tuneplane.collector.jsonl import JsonlDecoder
from tuneplane.collector.point_rules import (
    EARLIEST_WALL_TIME,
    INT64_MAX,
    INT64_MIN,
    MAX_FUTURE_S,
    PointScreen,
    number_problem,
    storable,
    text_problem,
)
from tuneplane.collector.points import ScalarPoint

NOW = 1.8e9


@given(
    step=st.integers(min_value=-(2**70), max_value=2**70),
    wall=st.none() | st.floats(allow_nan=True, allow_infinity=True),
    offset=st.integers(min_value=0, max_value=2**70),
)
@settings(max_examples=300, deadline=None)
def test_numbers_are_refused_exactly_outside_the_documented_ranges(
    step: int, wall: float | None, offset: int
) -> None:
    fits = (
        INT64_MIN <= step <= INT64_MAX
        and offset <= INT64_MAX
        and (
            wall is None
            or (math.isfinite(wall) and EARLIEST_WALL_TIME <= wall <= NOW + MAX_FUTURE_S)
        )
    )
    why = number_problem(step, wall, offset, NOW)
    assert (why is None) == fits, why
    if why is not None:
        assert why.startswith("the ")


def test_names_with_nul_or_lone_surrogates_are_refused_and_storable_keeps_them_readable() -> None:
    assert text_problem("tag", "train/loss", 1024) is None
    assert text_problem("tag", "", 1024) == "the tag is empty"
    assert "NUL" in (text_problem("tag", "a\x00b", 1024) or "")
    assert "lone surrogate" in (text_problem("tag", "a\ud800", 1024) or "")
    assert "more than 4" in (text_problem("tag", "x" * 5, 4) or "")
    assert storable("caf\udce9.jsonl") == "caf\\udce9.jsonl"
    assert storable("café.jsonl") == "café.jsonl"


def test_the_screen_keeps_good_points_and_turns_each_bad_one_into_data_loss() -> None:
    def point(step: int, wall: float | None, tag: str = "loss") -> ScalarPoint:
        return ScalarPoint("m.jsonl", tag, step, wall, math.nan, offset=step * 10)

    good, refused = PointScreen().screen(
        [point(1, NOW), point(2**63, NOW), point(3, 1e300), point(4, None), point(5, NOW, "\0")],
        NOW,
    )
    assert [p.step for p in good] == [1, 4]
    assert [(w.offset, w.kind, w.data_loss) for w in refused] == [
        (2**63 * 10, "not-shippable", True),
        (30, "not-shippable", True),
        (50, "not-shippable", True),
    ]


@given(st.lists(st.binary(max_size=200), max_size=20))
@settings(max_examples=300, deadline=None)
def test_the_jsonl_reader_never_raises_and_always_moves_on(lines: list[bytes]) -> None:
    data = b"\n".join(line.replace(b"\n", b" ") for line in lines) + b"\n"
    decoded = JsonlDecoder("m.jsonl").feed(data, 0, final=True)
    assert decoded.consumed == len(data)
    good, _ = PointScreen().screen(decoded.points, NOW)
    for p in good:
        p.tag.encode("utf-8")


def test_hostile_lines_are_warnings_with_their_offsets() -> None:
    lines = [
        b"[" * 50_000,
        b'{"step": 1, "x": ' + b"9" * 5000 + b"}",
        b'{"step": 1, "\\ud800": 1}',
        b'{"step": [[[[1]]]], "x": 1}',
        b'{"step": 2, "x": 1.5}',
    ]
    data = b"\n".join(lines) + b"\n"
    decoded = JsonlDecoder("m.jsonl").feed(data, 0)
    starts = [0]
    for line in lines[:-1]:
        starts.append(starts[-1] + len(line) + 1)
    assert [w.offset for w in decoded.warnings] == starts[:4]
    assert all(w.kind == "malformed-line" for w in decoded.warnings)
    assert [(p.step, p.tag, p.offset) for p in decoded.points] == [(2, "x", starts[4])]
