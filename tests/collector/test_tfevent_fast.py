"""The event-file decoder's fast path reads exactly what the general decoder reads.

Streams are built from real protobuf messages (tensorboardX's Event, Summary and TensorProto)
framed as TFRecords: scalars of every layout writers use, with and without metadata, steps of
every varint length (negative ones too), restarts, file versions, several values in one event,
non-scalar plugins, and corrupted or truncated records. Each stream is fed in random pieces, the
decoder restored from its snapshot between pieces, once with the fast path and once without;
points, warnings, marks, positions and snapshots must be the same.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensorboardX.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2

from bench.telemetry import write_event_file
from tuneplane.collector.files import read_file
from tuneplane.collector.points import Decoded, RestartMark
from tuneplane.collector.tfevent import TFEventDecoder
from tuneplane.collector.tfrecord import frame

TAGS = ("loss", "lr", "eval/acc", "héllo/ünïcode", "h")
ENCODINGS = (
    "simple",
    "float_val",
    "double_val",
    "tensor_content_float",
    "tensor_content_double",
    "float_val_no_shape",
    "vector",
)
PLUGINS = ("scalars", "histograms", "")


def scalar_value(
    tag: str, value: float, encoding: str, plugin: str | None
) -> summary_pb2.Summary.Value:
    if encoding == "simple":
        item = summary_pb2.Summary.Value(tag=tag, simple_value=value)
    else:
        double = encoding.endswith("double") or encoding == "double_val"
        tensor = tensor_pb2.TensorProto(dtype=2 if double else 1)
        if encoding != "float_val_no_shape":
            tensor.tensor_shape.CopyFrom(tensor_shape_pb2.TensorShapeProto())
        if encoding == "vector":
            tensor.tensor_shape.dim.add(size=2)
            tensor.float_val.extend([value, value])
        elif encoding.startswith("tensor_content"):
            tensor.tensor_content = struct.pack("<d" if double else "<f", value)
        elif encoding == "double_val":
            tensor.double_val.append(value)
        else:
            tensor.float_val.append(value)
        item = summary_pb2.Summary.Value(tag=tag, tensor=tensor)
    if plugin is not None:
        item.metadata.plugin_data.plugin_name = plugin
    return item


steps = st.one_of(
    st.integers(0, 127),
    st.integers(128, 2**21 - 1),
    st.integers(2**21, 2**40),
    st.integers(-(2**40), -1),
)
values = st.floats(width=32, allow_nan=True, allow_infinity=True)
# Mostly set: an unset wall time (0.0) is left out of the event, which the fast path leaves.
wall_times = st.sampled_from((0.0, 1.7e9, 1.7e9 + 0.25, 1.8e9, 1.6e9, 1.75e9))


@st.composite
def scalar_event(draw: st.DrawFn) -> Callable[[int], bytes]:
    count = draw(st.sampled_from((1, 1, 1, 1, 2, 0)))
    items = [
        scalar_value(
            draw(st.sampled_from(TAGS)),
            draw(values),
            draw(st.sampled_from(ENCODINGS)),
            draw(st.sampled_from((None, None, None, None, *PLUGINS))),
        )
        for _ in range(count)
    ]
    wall_time = draw(wall_times)
    summary = summary_pb2.Summary(value=items)
    return lambda step: event_pb2.Event(
        wall_time=wall_time, step=step, summary=summary
    ).SerializeToString()


@st.composite
def other_event(draw: st.DrawFn) -> Callable[[int], bytes]:
    kind = draw(st.sampled_from(("version", "start", "empty")))
    event = event_pb2.Event(wall_time=draw(wall_times))
    if kind == "version":
        event.file_version = draw(st.sampled_from(("brain.Event:2", "brain.Event:1")))
    elif kind == "start":
        event.session_log.status = event_pb2.SessionLog.START

    def build(step: int) -> bytes:
        event.step = step
        return bytes(event.SerializeToString())

    return build


@st.composite
def stream(draw: st.DrawFn) -> bytes:
    events = draw(
        st.lists(
            st.one_of(scalar_event(), scalar_event(), scalar_event(), other_event()),
            max_size=40,
        )
    )
    # Mostly rising steps, as writers write them, so runs of fast records are long; sometimes
    # any step, so that steps go back.
    if draw(st.booleans()):
        numbers = sorted(draw(st.lists(steps, min_size=len(events), max_size=len(events))))
    else:
        numbers = draw(st.lists(steps, min_size=len(events), max_size=len(events)))
    records = [frame(build(step)) for build, step in zip(events, numbers, strict=True)]
    for _ in range(draw(st.sampled_from((0, 0, 0, 1, 2)))):
        if not records:
            break
        which = draw(st.integers(0, len(records) - 1))
        record = bytearray(records[which])
        at = draw(st.integers(0, len(record) - 1))
        record[at] ^= draw(st.integers(1, 255))
        records[which] = bytes(record)
    data = b"".join(records)
    if data and draw(st.sampled_from((False, False, False, True))):
        data = data[: draw(st.integers(0, len(data) - 1))]
    return data


def comparable(decoded: Decoded) -> tuple[Any, ...]:
    points = [
        (p.source, p.tag, p.step, p.wall_time, struct.pack("<d", p.value), p.offset, p.index)
        for p in decoded.points
    ]
    return points, decoded.warnings, decoded.marks, decoded.consumed


def feed_in_pieces(data: bytes, cuts: list[int], *, fast: bool) -> list[tuple[Any, ...]]:
    """Feed ``data`` cut at ``cuts``, restoring the decoder from its snapshot before each piece,
    as the tailer does after a restart; what each feed returned, with the snapshot after it."""
    out = []
    state: dict[str, Any] | None = None
    pending = b""
    position = 0
    bounds = [*sorted(set(cuts)), len(data)]
    start = 0
    for i, end in enumerate(bounds):
        decoder = TFEventDecoder("f", "id", state, fast=fast)
        chunk = pending + data[start:end]
        decoded = decoder.feed(chunk, position, final=i == len(bounds) - 1)
        out.append((*comparable(decoded), decoder.snapshot()))
        pending = chunk[decoded.consumed :]
        position += decoded.consumed
        state = decoder.snapshot()
        start = end
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=stream(), cut_at=st.lists(st.floats(0, 1), max_size=3))
def test_the_fast_path_reads_what_the_general_decoder_reads(
    data: bytes, cut_at: list[float]
) -> None:
    cuts = [int(c * len(data)) for c in cut_at]
    assert feed_in_pieces(data, cuts, fast=True) == feed_in_pieces(data, cuts, fast=False)


def test_the_fast_path_takes_every_repeated_scalar(tmp_path: Path) -> None:
    """The benchmark's file: every record after the first of each tag is read by the fast
    path, and the result is the general decoder's, point for point."""
    path = tmp_path / "events.out.tfevents.x"
    write_event_file(path, 4000)
    data = path.read_bytes()
    fast, general = TFEventDecoder("f"), TFEventDecoder("f", fast=False)
    got, want = fast.feed(data, 0, final=True), general.feed(data, 0, final=True)
    assert comparable(got) == comparable(want)
    assert len(got.points) == 4000
    # The first value of each of the four tags teaches the decoder its plugin.
    assert fast.fast_points == 4000 - 4
    assert general.fast_points == 0
    assert read_file(path, "f")[0] == got.points


def test_a_step_that_goes_back_leaves_the_fast_path_for_the_restart_mark() -> None:
    def event(step: int, value: float) -> bytes:
        item = scalar_value("loss", value, "simple", None)
        message = event_pb2.Event(
            wall_time=1.7e9, step=step, summary=summary_pb2.Summary(value=[item])
        )
        return frame(message.SerializeToString())

    data = b"".join(event(s, float(s)) for s in (1, 2, 300, 5, 6))
    decoder = TFEventDecoder("f")
    out = decoder.feed(data, 0, final=True)
    assert [p.step for p in out.points] == [1, 2, 300, 5, 6]
    (mark,) = out.marks
    assert isinstance(mark, RestartMark)
    assert (mark.step, mark.tags) == (5, ("loss",))
    # The first record teaches the tag; the restart is read the general way; the rest fast.
    assert decoder.fast_points == 3


def fast_run(count: int) -> list[bytes]:
    return [
        frame(
            event_pb2.Event(
                wall_time=1.7e9,
                step=s,
                summary=summary_pb2.Summary(value=[scalar_value("x", 1.0, "simple", None)]),
            ).SerializeToString()
        )
        for s in range(count)
    ]


def test_a_corrupt_record_in_a_fast_run_is_reported_and_the_run_goes_on() -> None:
    records = fast_run(6)
    broken = bytearray(records[3])
    broken[-6] ^= 0xFF  # inside the data: the data CRC fails
    records[3] = bytes(broken)
    decoder = TFEventDecoder("f")
    out = decoder.feed(b"".join(records), 0, final=True)
    assert [p.step for p in out.points] == [0, 1, 2, 4, 5]
    assert [w.kind for w in out.warnings] == ["bad-data-crc"]
    assert decoder.fast_points == 4
    assert not math.isnan(out.points[0].value)


def test_a_header_whose_crc_fails_is_not_trusted_for_its_length() -> None:
    """The header's length is right but its CRC is not: the record is not read, as the
    splitter does not read it, even though its data CRC would match."""
    records = fast_run(6)
    broken = bytearray(records[3])
    broken[9] ^= 0x01  # the header's CRC
    records[3] = bytes(broken)
    data = b"".join(records)
    decoder = TFEventDecoder("f")
    out = decoder.feed(data, 0, final=True)
    assert comparable(out) == comparable(TFEventDecoder("f", fast=False).feed(data, 0, final=True))
    assert [p.step for p in out.points] == [0, 1, 2, 4, 5]
    assert [w.kind for w in out.warnings] == ["bad-length-crc"]
    # Records 1, 2 and 5: the splitter resyncs and reads record 4 itself.
    assert decoder.fast_points == 3
