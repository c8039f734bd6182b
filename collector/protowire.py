"""Protobuf wire format, read by hand: varints, field spans and the fixed-width codecs.

Rules: sans-IO and bounds-checked: a malformed message is a :class:`WireError`, never an
IndexError or a loop past the end; nothing here knows a message type (the decoders above it do).
Varints are read by :mod:`tuneplane.proto.varint`, which the coordinator's decoder shares.
"""

from __future__ import annotations

import struct

from tuneplane.proto.varint import WireError, read_varint

VARINT, I64, LEN, I32 = 0, 1, 2, 5
DOUBLE = struct.Struct("<d")
FLOAT = struct.Struct("<f")


def fields(buf: bytes, pos: int = 0, end: int = -1) -> list[tuple[int, int, int, int]]:
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
                key, pos = read_varint(buf, pos)
            wire_type = key & 7
            if wire_type == LEN:
                length = buf[pos]
                if length < 0x80:
                    start = pos + 1
                else:
                    length, start = read_varint(buf, pos)
                pos = start + length
            elif wire_type == I64:
                start = pos
                pos += 8
            elif wire_type == I32:
                start = pos
                pos += 4
            elif wire_type == VARINT:
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


def signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value
