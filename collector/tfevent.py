"""TensorBoard event files: TFRecord framing plus a hand-written decoder of the scalar fields.

Rules:
- Field numbers follow proto/tensorboard/summary.proto (our copy of TensorBoard's); every other
  field is skipped by its wire type, so unknown or large fields (graphs, images) cost a skip.
- Scalars are TF1 ``simple_value`` values and rank-0 float/double tensors whose tag's plugin is
  ``scalars``. Writers send a tag's metadata on its first value only, so the first metadata seen
  per tag is remembered (as TensorBoard does) and kept in the checkpointed state.
"""

from __future__ import annotations

import struct
from typing import Any

from tuneplane.collector.points import Decoded, ReadWarning, ScalarPoint
from tuneplane.collector.tfrecord import RecordSplitter

SCALARS_PLUGIN = "scalars"
DT_FLOAT = 1
DT_DOUBLE = 2

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_DOUBLE = struct.Struct("<d")
_FLOAT = struct.Struct("<f")


class WireError(ValueError):
    """A record passed its CRCs but is not a well-formed Event message."""


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    try:
        byte = buf[pos]
        if byte < 0x80:
            return byte, pos + 1
        result = byte & 0x7F
        shift = 7
        pos += 1
        while True:
            byte = buf[pos]
            pos += 1
            result |= (byte & 0x7F) << shift
            if byte < 0x80:
                return result, pos
            shift += 7
            if shift > 63:
                raise WireError("a varint runs longer than 10 bytes")
    except IndexError:
        raise WireError("a varint runs past the end of its message") from None


def _skip(buf: bytes, pos: int, wire_type: int) -> int:
    if wire_type == _VARINT:
        return _varint(buf, pos)[1]
    if wire_type == _I64:
        return pos + 8
    if wire_type == _LEN:
        length, pos = _varint(buf, pos)
        return pos + length
    if wire_type == _I32:
        return pos + 4
    raise WireError(f"wire type {wire_type} (groups) is not used by event files")


def _fields(buf: bytes) -> list[tuple[int, int, int, int]]:
    """(field number, wire type, start, end) of every field; for LEN fields start/end bound the
    payload, for others they bound the value bytes."""
    out: list[tuple[int, int, int, int]] = []
    pos = 0
    n = len(buf)
    while pos < n:
        key, pos = _varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == _LEN:
            length, start = _varint(buf, pos)
            pos = start + length
            out.append((number, wire_type, start, pos))
        else:
            start = pos
            pos = _skip(buf, pos, wire_type)
            out.append((number, wire_type, start, pos))
        if pos > n:
            raise WireError(f"field {number} runs past the end of its message")
    return out


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _plugin_name(metadata: bytes) -> str:
    for number, wire_type, start, end in _fields(metadata):
        if number == 1 and wire_type == _LEN:
            for inner, inner_type, s, e in _fields(metadata[start:end]):
                if inner == 1 and inner_type == _LEN:
                    return metadata[start:end][s:e].decode("utf-8", "replace")
    return ""


def tensor_scalar(tensor: bytes) -> float | None:
    """The value of a rank-0 float or double tensor; None for any other tensor."""
    dtype = 0
    rank = 0
    unknown_rank = False
    content = b""
    values: list[float] = []
    for number, wire_type, start, end in _fields(tensor):
        if number == 1 and wire_type == _VARINT:
            dtype = _varint(tensor, start)[0]
        elif number == 2 and wire_type == _LEN:
            for inner, inner_type, s, _e in _fields(tensor[start:end]):
                if inner == 2 and inner_type == _LEN:
                    rank += 1
                elif inner == 3 and inner_type == _VARINT:
                    unknown_rank = bool(_varint(tensor[start:end], s)[0])
        elif number == 4 and wire_type == _LEN:
            content = tensor[start:end]
        elif number == 5:
            width = _FLOAT.size
            values += [_FLOAT.unpack_from(tensor, p)[0] for p in range(start, end, width)]
        elif number == 6:
            width = _DOUBLE.size
            values += [_DOUBLE.unpack_from(tensor, p)[0] for p in range(start, end, width)]
    if rank or unknown_rank or dtype not in (DT_FLOAT, DT_DOUBLE):
        return None
    if values:
        return values[0] if len(values) == 1 else None
    if content:
        codec = _FLOAT if dtype == DT_FLOAT else _DOUBLE
        return codec.unpack(content)[0] if len(content) == codec.size else None
    # A rank-0 tensor with no values is the dtype's zero (TensorBoard's make_ndarray agrees).
    return 0.0


class TFEventDecoder:
    """Decodes an ``events.out.tfevents.*`` stream into scalar points (see :class:`Decoder`)."""

    def __init__(self, source: str, source_id: str = "", state: dict[str, Any] | None = None):
        self.source = source
        self.source_id = source_id or source
        state = state or {}
        self.plugins: dict[str, str] = dict(state.get("plugins", {}))
        self._splitter = RecordSplitter(resyncing=bool(state.get("resyncing", False)))

    def snapshot(self) -> dict[str, Any]:
        return {"plugins": dict(self.plugins), "resyncing": self._splitter.resyncing}

    def feed(self, data: bytes, offset: int, *, final: bool = False) -> Decoded:
        split = self._splitter.split(data, offset, final=final)
        warnings = [
            ReadWarning(self.source, c.offset, c.kind, c.message) for c in split.corruptions
        ]
        points: list[ScalarPoint] = []
        for record_offset, record in split.records:
            try:
                self._decode_event(record, record_offset, points, warnings)
            except (WireError, UnicodeDecodeError, struct.error) as exc:
                warnings.append(
                    ReadWarning(
                        self.source,
                        record_offset,
                        "malformed-event",
                        f"the record's CRCs match but it is not a valid Event ({exc}); "
                        "it is skipped",
                    )
                )
        return Decoded(points, warnings, split.consumed)

    def _decode_event(
        self, event: bytes, offset: int, out: list[ScalarPoint], warnings: list[ReadWarning]
    ) -> None:
        wall_time = 0.0
        step = 0
        summary: tuple[int, int] | None = None
        for number, wire_type, start, end in _fields(event):
            if number == 1 and wire_type == _I64:
                wall_time = _DOUBLE.unpack_from(event, start)[0]
            elif number == 2 and wire_type == _VARINT:
                step = _signed64(_varint(event, start)[0])
            elif number == 5 and wire_type == _LEN:
                summary = (start, end)
        if summary is None:
            return
        body = event[summary[0] : summary[1]]
        index = 0
        plugins = self.plugins
        for number, wire_type, start, end in _fields(body):
            if number != 1 or wire_type != _LEN:
                continue
            tag = ""
            simple: float | None = None
            metadata: bytes | None = None
            tensor: bytes | None = None
            value = body[start:end]
            for field, field_type, s, e in _fields(value):
                if field == 1 and field_type == _LEN:
                    tag = value[s:e].decode("utf-8")
                elif field == 2 and field_type == _I32:
                    simple = _FLOAT.unpack_from(value, s)[0]
                elif field == 9 and field_type == _LEN:
                    metadata = value[s:e]
                elif field == 8 and field_type == _LEN:
                    tensor = value[s:e]
            if tag not in plugins:
                if metadata is not None:
                    plugins[tag] = _plugin_name(metadata)
                elif simple is not None:
                    plugins[tag] = SCALARS_PLUGIN
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
                out.append(
                    ScalarPoint(
                        self.source, tag, step, wall_time, scalar, offset, index, self.source_id
                    )
                )
            index += 1
