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


def _fields(buf: bytes, pos: int = 0, end: int = -1) -> list[tuple[int, int, int, int]]:
    """(field number, wire type, start, end) of every field in ``buf[pos:end]``; for LEN fields
    start/end bound the payload, for others the value bytes. Offsets are into ``buf``."""
    out: list[tuple[int, int, int, int]] = []
    n = len(buf) if end < 0 else end
    append = out.append
    try:
        while pos < n:
            # One-byte keys and lengths are the common case: decode them inline.
            key = buf[pos]
            if key < 0x80:
                pos += 1
            else:
                key, pos = _varint(buf, pos)
            wire_type = key & 7
            if wire_type == _LEN:
                length = buf[pos]
                if length < 0x80:
                    start = pos + 1
                else:
                    length, start = _varint(buf, pos)
                pos = start + length
            elif wire_type == _I64:
                start = pos
                pos += 8
            elif wire_type == _I32:
                start = pos
                pos += 4
            elif wire_type == _VARINT:
                start = pos
                while buf[pos] >= 0x80:
                    pos += 1
                pos += 1
            else:
                raise WireError(f"wire type {wire_type} (groups) is not used by event files")
            append((key >> 3, wire_type, start, pos))
            if pos > n:
                raise WireError(f"field {key >> 3} runs past the end of its message")
    except IndexError:
        raise WireError("a field runs past the end of its message") from None
    return out


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _plugin_name(metadata: bytes) -> str:
    for number, wire_type, start, end in _fields(metadata):
        if number == 1 and wire_type == _LEN:
            for inner, inner_type, s, e in _fields(metadata, start, end):
                if inner == 1 and inner_type == _LEN:
                    return metadata[s:e].decode("utf-8", "replace")
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
            for inner, inner_type, s, _e in _fields(tensor, start, end):
                if inner == 2 and inner_type == _LEN:
                    rank += 1
                elif inner == 3 and inner_type == _VARINT:
                    unknown_rank = bool(_varint(tensor, s)[0])
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
        index = 0
        plugins = self.plugins
        for number, wire_type, start, end in _fields(event, summary[0], summary[1]):
            if number != 1 or wire_type != _LEN:
                continue
            tag = ""
            simple: float | None = None
            metadata: bytes | None = None
            tensor: bytes | None = None
            for field, field_type, s, e in _fields(event, start, end):
                if field == 1 and field_type == _LEN:
                    tag = event[s:e].decode("utf-8")
                elif field == 2 and field_type == _I32:
                    simple = _FLOAT.unpack_from(event, s)[0]
                elif field == 9 and field_type == _LEN:
                    metadata = event[s:e]
                elif field == 8 and field_type == _LEN:
                    tensor = event[s:e]
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
