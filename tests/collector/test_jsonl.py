"""JSONL metric lines: the accepted shapes, partial lines, and what is skipped and reported."""

from __future__ import annotations

import json

from tuneplane.collector.jsonl import MAX_LINE_BYTES, JsonlDecoder
from tuneplane.collector.points import ReadWarning, ScalarPoint


def feed_all(
    data: bytes, *, final: bool = True
) -> tuple[JsonlDecoder, list[ScalarPoint], list[ReadWarning], int]:
    decoder = JsonlDecoder("m.jsonl")
    out = decoder.feed(data, 0, final=final)
    return decoder, list(out.points), out.warnings, out.consumed


def test_nested_and_flat_shapes() -> None:
    data = (
        b'{"step": 1, "metrics": {"train/loss": 0.5, "lr": 1}, "wall_time": 1700000000.25}\n'
        b'{"step": 2, "train/loss": 0.25, "wall_time": 1700000001}\n'
        b'{"step": 3, "eval/acc": 0.75}\n'
    )
    _, points, warnings, consumed = feed_all(data)
    assert warnings == []
    assert consumed == len(data)
    got = [(p.tag, p.step, p.wall_time, p.value, p.offset, p.index) for p in points]
    second = data.index(b'{"step": 2')
    third = data.index(b'{"step": 3')
    assert got == [
        ("train/loss", 1, 1700000000.25, 0.5, 0, 0),
        ("lr", 1, 1700000000.25, 1.0, 0, 1),
        ("train/loss", 2, 1700000001.0, 0.25, second, 0),
        ("eval/acc", 3, None, 0.75, third, 0),
    ]


def test_hparams_and_blank_lines_are_not_scalars_nor_errors() -> None:
    _, points, warnings, _ = feed_all(b'{"hparams": {"lr": 0.1}, "wall_time": 1}\n\n  \n')
    assert points == [] and warnings == []


def test_partial_last_line_is_waited_for() -> None:
    decoder = JsonlDecoder("m.jsonl")
    line1 = b'{"step": 1, "loss": 1.0}\n'
    first = decoder.feed(line1 + b'{"step": 2, "lo', 0)
    assert [p.step for p in first.points] == [1]
    assert first.consumed == len(line1)
    assert first.warnings == []
    rest = b'{"step": 2, "loss": 2.0}\n'
    second = decoder.feed(rest, first.consumed)
    assert [(p.step, p.offset) for p in second.points] == [(2, len(line1))]
    assert decoder.lines == 2


def test_a_complete_last_line_without_newline_counts_once_the_writer_is_done() -> None:
    _, points, warnings, consumed = feed_all(b'{"step": 7, "loss": 3}', final=True)
    assert [(p.step, p.value) for p in points] == [(7, 3.0)]
    assert warnings == [] and consumed == 22
    _, points, warnings, _ = feed_all(b'{"step": 7, "lo', final=True)
    assert points == []
    assert [(w.kind, w.line, w.offset) for w in warnings] == [("truncated-line", 1, 0)]


def test_malformed_lines_are_skipped_with_line_numbers() -> None:
    data = (
        b'{"step": 1, "loss": 1}\n'
        b"not json\n"
        b"[1, 2]\n"
        b'{"loss": 2}\n'
        b'{"step": "3", "loss": 3}\n'
        b'{"step": 4, "metrics": [1]}\n'
        b'{"step": 5, "loss": 5}\n'
    )
    _, points, warnings, _ = feed_all(data)
    assert [p.step for p in points] == [1, 5]
    assert [(w.kind, w.line) for w in warnings] == [("malformed-line", n) for n in (2, 3, 4, 5, 6)]
    assert warnings[0].offset == data.index(b"not json")
    assert all(w.data_loss and w.source == "m.jsonl" for w in warnings)
    assert "'step'" in warnings[2].message


def test_non_numeric_values_are_skipped_one_by_one() -> None:
    data = b'{"step": 1, "metrics": {"a": "0.5", "b": true, "c": null, "d": {"x": 1}, "e": 2}}\n'
    _, points, warnings, _ = feed_all(data)
    assert [(p.tag, p.value, p.index) for p in points] == [("e", 2.0, 4)]
    assert [w.kind for w in warnings] == ["non-numeric"] * 4
    assert "'a'" in warnings[0].message and '"0.5"' in warnings[0].message


def test_nan_and_infinity_are_values() -> None:
    _, points, warnings, _ = feed_all(b'{"step": 1, "a": NaN, "b": Infinity, "c": 1e400}\n')
    assert warnings == []
    assert [p.tag for p in points] == ["a", "b", "c"]


def test_over_long_lines_are_bounded_and_skipped() -> None:
    big = json.dumps({"step": 2, "blob": "x" * (MAX_LINE_BYTES + 10)}).encode()
    decoder = JsonlDecoder("m.jsonl")
    line1 = b'{"step": 1, "loss": 1}\n'
    # The long line arrives without its end: reported once, memory stays bounded.
    first = decoder.feed(line1 + big[: MAX_LINE_BYTES + 5], 0)
    assert [p.step for p in first.points] == [1]
    assert [(w.kind, w.line, w.offset) for w in first.warnings] == [
        ("line-too-long", 2, len(line1))
    ]
    assert first.consumed == len(line1) + MAX_LINE_BYTES + 5
    rest = big[MAX_LINE_BYTES + 5 :] + b'\n{"step": 3, "loss": 3}\n'
    second = decoder.feed(rest, first.consumed)
    assert [(p.step, p.value) for p in second.points] == [(3, 3.0)]
    assert second.warnings == []
    assert decoder.lines == 3
    # A complete over-long line in one piece is skipped the same way.
    _, points, warnings, _ = feed_all(big + b'\n{"step": 4, "loss": 4}\n')
    assert [p.step for p in points] == [4]
    assert [(w.kind, w.line) for w in warnings] == [("line-too-long", 1)]


def test_state_round_trips_through_a_snapshot() -> None:
    decoder = JsonlDecoder("m.jsonl")
    decoder.feed(b'{"step": 1, "a": 1}\nbad\n', 0)
    resumed = JsonlDecoder("m.jsonl", state=decoder.snapshot())
    out = resumed.feed(b"also bad\n", 24)
    assert [(w.line, w.offset) for w in out.warnings] == [(3, 24)]
