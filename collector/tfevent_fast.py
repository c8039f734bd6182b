"""The event-file decoder's fast path: the common one-scalar event read by its fixed layout.

Rules:
- A writer's scalar event is almost always ``wall_time``, ``step`` and a summary holding one
  value: a tag and either a ``simple_value`` or a rank-0 float/double tensor laid out one of a
  few ways. Past the step, such a record is a byte string fixed by its tag (its *shape*) and
  then the value's 4 or 8 bytes, so one dictionary lookup recognises it.
- A shape is registered only for a tag whose plugin the decoder already knows, and only where
  the general decoder (:mod:`.tfevent`) reads those bytes as exactly that one point and nothing
  else: a ``simple_value`` for any known tag, a tensor only for a tag of the ``scalars``
  plugin (a tag's plugin never changes once known). Anything else -- metadata, several values,
  a session log, a file version, an unknown layout, a step that would orphan points -- stops
  the fast path, and the general decoder takes that record.
- Framing is checked as :mod:`.tfrecord` checks it, both CRCs: a header already seen valid
  (same length, same CRC) is looked up instead of recomputed. A record with any fault stops the
  fast path, and the splitter reports it.
"""

from __future__ import annotations

import struct

import google_crc32c

from tuneplane.proto.varint import WireError, read_varint

from .points import ScalarColumns
from .protowire import signed64
from .tb_runs import RunState
from .tfrecord import _MASK_DELTA, header_length

SCALARS_PLUGIN = "scalars"
#: The valid headers remembered; a file's records take few lengths, so this is seldom reached.
MAX_HEADERS = 1024
#: The shortest record the fast path reads: wall time (9 bytes), the step's key, a summary.
_MIN_EVENT_BYTES = 16
_WALL_TIME_KEY = 0x09
_STEP_KEY = 0x10
#: TensorProto bytes before a rank-0 value: dtype, then an empty shape or none, then the
#: values field's key and length (``float_val``/``double_val`` packed, or ``tensor_content``).
_FLOAT_TENSORS = tuple(
    bytes.fromhex(h) for h in ("080112002a04", "08012a04", "080112002204", "08012204")
)
#: A value that ends a record's data, and the data's CRC after it.
_FLOAT_CRC = struct.Struct("<fI")
_DOUBLE_CRC = struct.Struct("<dI")
#: An event's first byte (its wall time's key) and the wall time.
_KEY_DOUBLE = struct.Struct("<Bd")
_DOUBLE_TENSORS = tuple(
    bytes.fromhex(h) for h in ("080212003208", "08023208", "080212002208", "08022208")
)


def encode_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _length_delimited(key: int, payload: bytes) -> bytes:
    return bytes((key,)) + encode_varint(len(payload)) + payload


def _shape(tag_field: bytes, value_field: bytes, width: int) -> bytes:
    """The event's bytes from the summary's key up to the value's last ``width`` bytes."""
    summary = _length_delimited(0x2A, _length_delimited(0x0A, tag_field + value_field))
    return summary[:-width]


class FastScalars:
    """Shapes and valid headers of one decoder; :meth:`scan` reads records while they fit."""

    def __init__(self) -> None:
        self.floats: dict[bytes, str] = {}
        self.doubles: dict[bytes, str] = {}
        self.headers: dict[bytes, int] = {}

    def learn(self, tag: str, plugin: str) -> None:
        """``tag``'s plugin is now known to be ``plugin``: register the shapes it allows."""
        tag_field = _length_delimited(0x0A, tag.encode("utf-8"))
        self.floats[_shape(tag_field, b"\x15" + bytes(4), 4)] = tag
        if plugin != SCALARS_PLUGIN:
            return
        for prefix in _FLOAT_TENSORS:
            self.floats[_shape(tag_field, _length_delimited(0x42, prefix + bytes(4)), 4)] = tag
        for prefix in _DOUBLE_TENSORS:
            self.doubles[_shape(tag_field, _length_delimited(0x42, prefix + bytes(8)), 8)] = tag

    def scan(self, buf: bytes, pos: int, offset: int, run: RunState, out: ScalarColumns) -> int:
        """Decode the records of ``buf`` from ``pos`` into ``out`` while each one is complete,
        sound and of a known shape; return where the first other record (or the end) begins.
        ``run`` advances as the general decoder would advance it. The loop spells its constants
        as literals (each named beside it): it runs once per scalar."""
        n = len(buf)
        headers, floats, doubles = self.headers, self.floats, self.doubles
        crc = google_crc32c.value
        unpack_float_crc = _FLOAT_CRC.unpack_from
        unpack_double_crc = _DOUBLE_CRC.unpack_from
        unpack_key_double = _KEY_DOUBLE.unpack_from
        add_tag, add_step = out.tags.append, out.steps.append
        add_wall, add_value = out.wall_times.append, out.values.append
        add_offset = out.offsets.append
        versioned = bool(run.file_version and run.file_version >= 2)
        mask_delta = _MASK_DELTA
        last = run.most_recent_step
        while n - pos >= 16:  # HEADER_BYTES + FOOTER_BYTES
            header = buf[pos : pos + 12]
            length = headers.get(header)
            if length is None:
                length = header_length(header)
                if length is None:
                    break
                if len(headers) >= MAX_HEADERS:
                    headers.clear()
                headers[header] = length
            start = pos + 12
            end = start + length
            if end + 4 > n or length < 16:  # a footer; _MIN_EVENT_BYTES
                break
            data = buf[start:end]
            key, wall_time = unpack_key_double(data, 0)
            if key != 0x09:  # _WALL_TIME_KEY
                break
            if data[9] == 0x10:  # _STEP_KEY
                step = data[10]
                p = 11
                if step >= 0x80:  # a longer varint: two and three bytes inline
                    b1 = data[11]
                    if b1 < 0x80:
                        step = (step & 0x7F) | (b1 << 7)
                        p = 12
                    elif data[12] < 0x80:
                        step = (step & 0x7F) | ((b1 & 0x7F) << 7) | (data[12] << 14)
                        p = 13
                    else:
                        try:
                            raw, p = read_varint(data, 10)
                        except WireError:
                            break  # the general decoder reports the malformed step
                        step = signed64(raw)
            else:
                step = 0
                p = 9
            # The value ends the data and the data's CRC follows it: one unpack reads both.
            tag = floats.get(data[p:-4])
            if tag is not None:
                value, data_crc = unpack_float_crc(buf, end - 4)
            else:
                tag = doubles.get(data[p:-8])
                if tag is None:
                    break
                value, data_crc = unpack_double_crc(buf, end - 8)
            c = crc(data)
            if (((c >> 15) | (c << 17)) + mask_delta) & 0xFFFFFFFF != data_crc:
                break
            if step < last and not versioned:
                break  # the general decoder emits the restart mark
            last = step
            add_tag(tag)
            add_step(step)
            add_wall(wall_time)
            add_value(value)
            add_offset(offset + pos)
            pos = end + 4
        run.most_recent_step = last
        out.indexes += [0] * (len(out.tags) - len(out.indexes))  # one value per event
        return pos
