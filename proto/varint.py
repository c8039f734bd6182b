"""Protobuf varints read by hand: the one reader behind the collector's event-file decoder and
the coordinator's bounded decoder of incoming messages.

Rules: sans-IO and bounds-checked: a varint that runs past the end of its bytes, or past the
10 bytes protobuf allows, is a :class:`WireError`, never an IndexError or a loop past the end.
"""

from __future__ import annotations


class WireError(ValueError):
    """Bytes that are not well-formed protobuf; ``str()`` says what is wrong."""


def read_varint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    """The varint at ``buf[pos:]`` and where it ends."""
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
