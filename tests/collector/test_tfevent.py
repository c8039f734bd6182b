"""Our event-file decoder against TensorBoard's own reader, on files real writers produced."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from tensorboardX import FileWriter, SummaryWriter
from tensorboardX.proto import summary_pb2

from tests.collector.tb_writers import (
    new_style_value,
    tensorboard_scalars,
    write_new_style,
    write_simple,
)
from tuneplane.collector.files import read_file, telemetry_files
from tuneplane.collector.points import ScalarPoint
from tuneplane.collector.tfevent import TFEventDecoder
from tuneplane.collector.tfrecord import frame


def ours(logdir: Path) -> dict[str, list[tuple[int, float, float]]]:
    out: dict[str, list[tuple[int, float, float]]] = {}
    for path in telemetry_files(logdir):
        points, warnings = read_file(path, path.name)
        assert warnings == []
        for p in points:
            assert p.wall_time is not None
            out.setdefault(p.tag, []).append((p.step, p.wall_time, p.value))
    return out


SERIES = {
    "train/loss": [(s, 2.0 / (s + 1)) for s in range(60)],
    "lr": [(s, 1e-4 * (0.99**s)) for s in range(0, 60, 3)],
    "eval/acc": [(s, 0.0 if s == 0 else s / 100) for s in range(0, 60, 10)],
}


def test_simple_value_scalars_match_tensorboard(tmp_path: Path) -> None:
    write_simple(tmp_path, SERIES)
    expected = tensorboard_scalars(tmp_path)
    assert set(expected) == set(SERIES)
    assert ours(tmp_path) == expected


@pytest.mark.parametrize("encoding", ["float_val", "double_val", "tensor_content"])
def test_tensor_scalars_match_tensorboard(tmp_path: Path, encoding: str) -> None:
    write_new_style(tmp_path, SERIES, encoding=encoding)
    expected = tensorboard_scalars(tmp_path)
    assert set(expected) == set(SERIES)
    assert ours(tmp_path) == expected
    if encoding == "double_val":
        # Doubles keep full precision: no float32 rounding on the way.
        assert ours(tmp_path)["lr"][1][2] == 1e-4 * 0.99**3


def test_only_the_first_metadata_of_a_tag_counts(tmp_path: Path) -> None:
    writer = FileWriter(str(tmp_path))
    # "hist" declares another plugin first; later values claim "scalars" but TensorBoard keeps
    # the first metadata, so none of them is a scalar. "plain" never declares a plugin.
    first = new_style_value("hist", 1.0, encoding="float_val", with_metadata=False)
    first.metadata.plugin_data.plugin_name = "histograms"
    writer.add_summary(summary_pb2.Summary(value=[first]), 0)
    later = new_style_value("hist", 2.0, encoding="float_val", with_metadata=True)
    plain = new_style_value("plain", 3.0, encoding="float_val", with_metadata=False)
    scalar = new_style_value("loss", 4.0, encoding="float_val", with_metadata=True)
    writer.add_summary(summary_pb2.Summary(value=[later, plain, scalar]), 1)
    writer.close()
    assert ours(tmp_path) == tensorboard_scalars(tmp_path)
    assert list(ours(tmp_path)) == ["loss"]


def test_plugin_memory_survives_a_checkpoint(tmp_path: Path) -> None:
    write_new_style(tmp_path, {"loss": [(s, float(s)) for s in range(5)]})
    (path,) = telemetry_files(tmp_path)
    data = path.read_bytes()
    whole, _ = read_file(path, "f")
    # Stop after the record that carried the metadata, restore from the snapshot, continue.
    split = whole[1].offset
    first = TFEventDecoder("f")
    head = first.feed(data[:split], 0)
    resumed = TFEventDecoder("f", state=first.snapshot())
    tail = resumed.feed(data[head.consumed :], head.consumed, final=True)
    assert [*head.points, *tail.points] == whole
    assert TFEventDecoder("f").feed(data[split:], split).points == []


def test_special_values_steps_and_non_scalars(tmp_path: Path) -> None:
    writer = SummaryWriter(str(tmp_path))
    writer.add_scalar("x", float("nan"), 0)
    writer.add_scalar("x", float("inf"), 1)
    writer.add_scalar("x", -0.5, 2**40)
    writer.add_histogram("h", [1.0, 2.0, 3.0], 0)
    writer.add_text("t", "hello", 0)
    writer.close()
    points = [p for f in telemetry_files(tmp_path) for p in read_file(f, "f")[0]]
    assert [p.tag for p in points] == ["x", "x", "x"]
    assert math.isnan(points[0].value)
    assert points[1].value == math.inf
    assert (points[2].step, points[2].value) == (2**40, -0.5)


def test_a_scalars_plugin_tensor_that_is_not_rank_zero_is_reported(tmp_path: Path) -> None:
    writer = FileWriter(str(tmp_path))
    value = new_style_value("loss", 1.0, encoding="float_val", with_metadata=True)
    value.tensor.tensor_shape.dim.add(size=1)
    writer.add_summary(summary_pb2.Summary(value=[value]), 0)
    writer.close()
    (path,) = telemetry_files(tmp_path)
    points, warnings = read_file(path, "f")
    assert points == []
    assert [w.kind for w in warnings] == ["not-a-scalar"]
    assert "'loss'" in warnings[0].message


def test_dedup_keys_are_unique_and_stable(tmp_path: Path) -> None:
    write_new_style(tmp_path, SERIES)
    (path,) = telemetry_files(tmp_path)
    first, _ = read_file(path, "f")
    second, _ = read_file(path, "f")
    keys = [p.dedup_key for p in first]
    assert len(set(keys)) == len(keys) == sum(len(v) for v in SERIES.values())
    assert keys == [p.dedup_key for p in second]
    assert isinstance(first[0], ScalarPoint)


def test_a_record_that_is_not_an_event_is_reported_not_fatal() -> None:
    garbage = frame(b"\x2a\xff\xff\xff\x0f")  # field 5 (summary) claiming 4 GiB
    good = frame(bytes.fromhex("10052a0a0a080a01781500002040"))  # step 5, x = 2.5
    out = TFEventDecoder("f").feed(garbage + good, 0, final=True)
    assert [(p.tag, p.step, p.value) for p in out.points] == [("x", 5, 2.5)]
    assert [(w.kind, w.offset) for w in out.warnings] == [("malformed-event", 0)]
