"""Real TensorBoard writers for tests, and TensorBoard's own reader to compare against.

tensorboardX writes TF1 ``simple_value`` scalars through ``add_scalar``; new-style (TF2)
scalars are rank-0 tensors with the ``scalars`` plugin, written here through tensorboardX's own
``FileWriter`` with its Summary/Tensor messages, metadata on the first value of each tag only,
exactly as TensorFlow's summary writer does.
"""

from __future__ import annotations

import struct
from pathlib import Path

from tensorboard.backend.event_processing import plugin_event_accumulator
from tensorboard.util import tensor_util
from tensorboardX import FileWriter, SummaryWriter
from tensorboardX.proto import summary_pb2, tensor_pb2, tensor_shape_pb2

Series = dict[str, list[tuple[int, float]]]


def write_simple(logdir: Path, series: Series, *, suffix: str = "") -> None:
    """TF1 scalars through SummaryWriter.add_scalar, steps interleaved across tags."""
    writer = SummaryWriter(str(logdir), filename_suffix=suffix)
    steps = sorted({step for values in series.values() for step, _ in values})
    for step in steps:
        for tag, values in series.items():
            for s, value in values:
                if s == step:
                    writer.add_scalar(tag, value, s)
    writer.close()


def new_style_value(
    tag: str, value: float, *, encoding: str, with_metadata: bool
) -> summary_pb2.Summary.Value:
    dtype = 2 if encoding == "double_val" else 1
    tensor = tensor_pb2.TensorProto(dtype=dtype, tensor_shape=tensor_shape_pb2.TensorShapeProto())
    if encoding == "float_val":
        tensor.float_val.append(value)
    elif encoding == "double_val":
        tensor.double_val.append(value)
    else:
        tensor.tensor_content = struct.pack("<f", value)
    result = summary_pb2.Summary.Value(tag=tag, tensor=tensor)
    if with_metadata:
        result.metadata.CopyFrom(
            summary_pb2.SummaryMetadata(
                plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
            )
        )
    return result


def write_new_style(logdir: Path, series: Series, *, encoding: str = "float_val") -> None:
    """TF2-style tensor scalars; each tag's metadata only on its first value."""
    writer = FileWriter(str(logdir))
    seen: set[str] = set()
    steps = sorted({step for values in series.values() for step, _ in values})
    for step in steps:
        values = []
        for tag, points in series.items():
            for s, value in points:
                if s == step:
                    values.append(
                        new_style_value(
                            tag, value, encoding=encoding, with_metadata=tag not in seen
                        )
                    )
                    seen.add(tag)
        writer.add_summary(summary_pb2.Summary(value=values), step)
    writer.close()


def tensorboard_scalars(
    logdir: Path, *, purge: bool = False
) -> dict[str, list[tuple[int, float, float]]]:
    """What TensorBoard itself reads: tag -> [(step, wall_time, value)] in file order. With
    ``purge``, orphaned points of restarted writers are dropped, as TensorBoard's server does."""
    acc = plugin_event_accumulator.EventAccumulator(
        str(logdir), size_guidance={"tensors": 0}, purge_orphaned_data=purge
    )
    acc.Reload()
    out: dict[str, list[tuple[int, float, float]]] = {}
    scalar_tags = (
        set(acc.PluginTagToContent("scalars")) if "scalars" in acc.ActivePlugins() else set()
    )
    for tag in acc.Tags()["tensors"]:
        if tag not in scalar_tags:
            continue
        out[tag] = [
            (e.step, e.wall_time, float(tensor_util.make_ndarray(e.tensor_proto).item()))
            for e in acc.Tensors(tag)
        ]
    return out
