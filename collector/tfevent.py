"""TensorBoard event files: TFRecord framing plus a hand-written decoder of the scalar fields.

Rules:
- Field numbers follow proto/tensorboard/summary.proto (our copy of TensorBoard's); every other
  field is skipped by its wire type, so unknown or large fields (graphs, images) cost a skip.
- Scalars are TF1 ``simple_value`` values and rank-0 float/double tensors whose tag's plugin is
  ``scalars``. Writers send a tag's metadata on its first value only, so the first metadata seen
  per tag is remembered (as TensorBoard does) and kept in the checkpointed state.
- Restarted writers are judged as TensorBoard's reader judges them (:class:`.tb_runs.RunState`,
  kept in the checkpointed state and carried from one event file of a run directory to the
  next): the decoder emits a :class:`RestartMark` wherever TensorBoard would purge orphaned
  points, and the coordinator honours it. The hparams plugin's session start (names and values)
  and experiment (metric names) become :class:`HParamsMark` records (:mod:`.tb_hparams`).
- The wire format itself (varints, field spans) is :mod:`.protowire`; the common one-scalar
  event is read by its fixed layout (:mod:`.tfevent_fast`), and every other record here.
"""

from __future__ import annotations

import math
import struct
from typing import Any

from tuneplane.proto.varint import WireError, read_varint

from .point_rules import MAX_MARK_NAMES
from .points import (
    Decoded,
    HParamsMark,
    Mark,
    ReadWarning,
    RestartMark,
    ScalarColumns,
)
from .protowire import DOUBLE, FLOAT, I32, I64, LEN, VARINT, fields, signed64
from .tb_hparams import MAX_HPARAMS, bounded_hparams, hparams_plugin_data, plugin_content
from .tb_runs import RunState
from .tfevent_fast import FastScalars
from .tfrecord import RecordSplitter

SCALARS_PLUGIN = "scalars"
HPARAMS_PLUGIN = "hparams"
#: ``SessionLog.status`` of a (re)started writer.
SESSION_START = 1
#: A by-tag restart names at most this many tags; a larger event is sent as "every tag" (the
#: coordinator then orphans a little more than TensorBoard would, never less).
MAX_RESTART_TAGS = MAX_MARK_NAMES
DT_FLOAT = 1
DT_DOUBLE = 2


def _plugin_name(metadata: bytes) -> str:
    for number, wire_type, start, end in fields(metadata):
        if number == 1 and wire_type == LEN:
            for inner, inner_type, s, e in fields(metadata, start, end):
                if inner == 1 and inner_type == LEN:
                    return metadata[s:e].decode("utf-8", "replace")
    return ""


def tensor_scalar(tensor: bytes) -> float | None:
    """The value of a rank-0 float or double tensor; None for any other tensor."""
    dtype = 0
    rank = 0
    unknown_rank = False
    content = b""
    values: list[float] = []
    for number, wire_type, start, end in fields(tensor):
        if number == 1 and wire_type == VARINT:
            dtype = read_varint(tensor, start)[0]
        elif number == 2 and wire_type == LEN:
            for inner, inner_type, s, _e in fields(tensor, start, end):
                if inner == 2 and inner_type == LEN:
                    rank += 1
                elif inner == 3 and inner_type == VARINT:
                    unknown_rank = bool(read_varint(tensor, s)[0])
        elif number == 4 and wire_type == LEN:
            content = tensor[start:end]
        elif number == 5:
            width = FLOAT.size
            values += [FLOAT.unpack_from(tensor, p)[0] for p in range(start, end, width)]
        elif number == 6:
            width = DOUBLE.size
            values += [DOUBLE.unpack_from(tensor, p)[0] for p in range(start, end, width)]
    if rank or unknown_rank or dtype not in (DT_FLOAT, DT_DOUBLE):
        return None
    if values:
        return values[0] if len(values) == 1 else None
    if content:
        codec = FLOAT if dtype == DT_FLOAT else DOUBLE
        return codec.unpack(content)[0] if len(content) == codec.size else None
    # A rank-0 tensor with no values is the dtype's zero (TensorBoard's make_ndarray agrees).
    return 0.0


class TFEventDecoder:
    """Decodes an ``events.out.tfevents.*`` stream into scalar points (see :class:`Decoder`)."""

    def __init__(
        self,
        source: str,
        source_id: str = "",
        state: dict[str, Any] | None = None,
        *,
        fast: bool = True,
    ):
        self.source = source
        self.source_id = source_id or source
        state = state or {}
        self.plugins: dict[str, str] = dict(state.get("plugins", {}))
        self.run = RunState.from_json(state.get("run"))
        self._splitter = RecordSplitter(resyncing=bool(state.get("resyncing", False)))
        # ``fast=False`` reads every record the general way (the tests compare the two).
        self._fast = FastScalars() if fast else None
        #: Points the fast path decoded (the tests check it is taken).
        self.fast_points = 0
        for tag, plugin in list(self.plugins.items()):
            self._learn(tag, plugin)

    def _learn(self, tag: str, plugin: str) -> None:
        self.plugins[tag] = plugin
        if self._fast is not None:
            self._fast.learn(tag, plugin)

    def snapshot(self) -> dict[str, Any]:
        return {
            "plugins": dict(self.plugins),
            "resyncing": self._splitter.resyncing,
            "run": self.run.to_json(),
        }

    def feed(self, data: bytes, offset: int, *, final: bool = False) -> Decoded:
        points = ScalarColumns(self.source, self.source_id)
        warnings: list[ReadWarning] = []
        marks: list[Mark] = []
        pos = 0
        while True:
            if self._fast is not None and not self._splitter.resyncing:
                before = len(points)
                pos = self._fast.scan(data, pos, offset, self.run, points)
                self.fast_points += len(points) - before
            # The record the fast path stopped at, or a fault, the general way.
            split = self._splitter.split(data, offset, final=final, start=pos, max_records=1)
            warnings += (
                ReadWarning(self.source, c.offset, c.kind, c.message) for c in split.corruptions
            )
            for record_offset, record in split.records:
                self._decode_record(record, record_offset, points, warnings, marks)
            if split.consumed == pos:
                return Decoded(points, warnings, pos, marks)
            pos = split.consumed

    def _decode_record(
        self,
        record: bytes,
        offset: int,
        points: ScalarColumns,
        warnings: list[ReadWarning],
        marks: list[Mark],
    ) -> None:
        try:
            self._decode_event(record, offset, points, warnings, marks)
        except (WireError, UnicodeDecodeError, struct.error) as exc:
            warnings.append(
                ReadWarning(
                    self.source,
                    offset,
                    "malformed-event",
                    f"the record's CRCs match but it is not a valid Event ({exc}); it is skipped",
                )
            )

    def _decode_event(
        self,
        event: bytes,
        offset: int,
        out: ScalarColumns,
        warnings: list[ReadWarning],
        marks: list[Mark],
    ) -> None:
        wall_time = 0.0
        step = 0
        summary: tuple[int, int] | None = None
        file_version: str | None = None
        session_start = False
        for number, wire_type, start, end in fields(event):
            if number == 1 and wire_type == I64:
                wall_time = DOUBLE.unpack_from(event, start)[0]
            elif number == 2 and wire_type == VARINT:
                step = signed64(read_varint(event, start)[0])
            elif number == 3 and wire_type == LEN:
                file_version = event[start:end].decode("utf-8", "replace")
            elif number == 5 and wire_type == LEN:
                summary = (start, end)
            elif number == 7 and wire_type == LEN:
                for inner, inner_type, s, _e in fields(event, start, end):
                    if inner == 1 and inner_type == VARINT:
                        session_start = read_varint(event, s)[0] == SESSION_START
        tags: tuple[str, ...] | None = None
        if summary is not None:
            tags = tuple(
                _value_tag(event, start, end)
                for number, wire_type, start, end in fields(event, summary[0], summary[1])
                if number == 1 and wire_type == LEN
            )
        orphans = self.run.event(
            step, file_version=file_version, session_start=session_start, summary_tags=tags
        )
        if orphans is not False:
            if isinstance(orphans, tuple):
                unique = tuple(dict.fromkeys(orphans))
                orphans = unique if len(unique) <= MAX_RESTART_TAGS else None
            when = wall_time if math.isfinite(wall_time) and wall_time > 0 else None
            marks.append(RestartMark(self.source, self.source_id, offset, step, orphans, when))
        if summary is None:
            return
        index = 0
        plugins = self.plugins
        for number, wire_type, start, end in fields(event, summary[0], summary[1]):
            if number != 1 or wire_type != LEN:
                continue
            tag = ""
            simple: float | None = None
            metadata: bytes | None = None
            tensor: bytes | None = None
            for field, field_type, s, e in fields(event, start, end):
                if field == 1 and field_type == LEN:
                    tag = event[s:e].decode("utf-8")
                elif field == 2 and field_type == I32:
                    simple = FLOAT.unpack_from(event, s)[0]
                elif field == 9 and field_type == LEN:
                    metadata = event[s:e]
                elif field == 8 and field_type == LEN:
                    tensor = event[s:e]
            if tag not in plugins:
                if metadata is not None:
                    self._learn(tag, _plugin_name(metadata))
                elif simple is not None:
                    self._learn(tag, SCALARS_PLUGIN)
            if metadata is not None and plugins.get(tag) == HPARAMS_PLUGIN:
                mark = self._hparams(metadata, offset, index, warnings)
                if mark is not None:
                    marks.append(mark)
            scalar = simple
            if scalar is None and tensor is not None and plugins.get(tag) == SCALARS_PLUGIN:
                scalar = tensor_scalar(tensor)
                if scalar is None:
                    warnings.append(
                        ReadWarning(
                            self.source,
                            offset,
                            "not-a-scalar",
                            f"tag {tag!r} belongs to the scalars plugin but its tensor is not a "
                            "rank-0 float or double; the value is skipped",
                        )
                    )
            if scalar is not None:
                out.add(tag, step, wall_time, scalar, offset, index)
            index += 1

    def _hparams(
        self, metadata: bytes, offset: int, index: int, warnings: list[ReadWarning]
    ) -> HParamsMark | None:
        hparams, metrics = hparams_plugin_data(plugin_content(metadata))
        if not hparams and not metrics:
            return None
        kept, why = bounded_hparams(hparams)
        for problem in why:
            warnings.append(
                ReadWarning(self.source, offset, "hparam-skipped", problem, data_loss=False)
            )
        return HParamsMark(
            self.source, self.source_id, offset, index, kept, tuple(metrics[:MAX_HPARAMS])
        )


def _value_tag(buf: bytes, start: int, end: int) -> str:
    for field, field_type, s, e in fields(buf, start, end):
        if field == 1 and field_type == LEN:
            return buf[s:e].decode("utf-8")
    return ""
