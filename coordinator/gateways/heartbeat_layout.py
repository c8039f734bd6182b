"""The control stream's commonest exchange, Heartbeat in and HeartbeatAck out, by its layout.

At 10,000 Nodes the coordinator hears 2,000 Heartbeats a second and acks each one. Through
betterproto a Heartbeat cost about 57 us to decode and check (building the message, the counts,
the field checks of :mod:`~tuneplane.proto.contract.input_checks`) and its ack about 45 us to
build and encode: a fifth of the coordinator's time per heartbeat, spent on two integers.

Rules:
- :func:`plain_heartbeat` recognises a NodeMessage that holds a Heartbeat with nothing but its
  ``seq`` and ``sent_at_ms`` (each a varint of at most 9 bytes; in any order, and a field given
  twice is read as protobuf reads it, the last one wins). Anything else is ``None``, and the
  caller decodes it in full with every check: an inventory, another body, an unknown field, a
  second Heartbeat (protobuf would merge them), a longer varint, a length that does not match.
  What it recognises holds two integers, which no check refuses.
- :func:`heartbeat_ack` is, byte for byte, betterproto's encoding of
  ``CoordinatorMessage(heartbeat_ack=HeartbeatAck(seq=seq))``.
- Field numbers are read from the generated classes, so a renumbered field cannot be misread
  (``tests/coordinator/test_heartbeat_layout.py`` compares both functions with betterproto).
"""

from __future__ import annotations

import betterproto
from betterproto import encode_varint

from tuneplane.proto import v1
from tuneplane.proto.varint import read_varint

from .bounded_decode import field_numbers

_LENGTH_DELIMITED = 2
_VARINT = 0
# The longest varint read here: 9 bytes carry 63 bits, so every value is below 2**63 and reads
# the same as uint64 (seq) and as int64 (sent_at_ms); a 10-byte one is left to betterproto.
_MAX_VARINT_BYTES = 9


def _key(cls: type[betterproto.Message], field: str, wire_type: int) -> bytes:
    """The encoded key of ``cls``'s field ``field`` (its number read from the class)."""
    (number,) = field_numbers(cls, field)
    return encode_varint(number << 3 | wire_type)


_HEARTBEAT = _key(v1.NodeMessage, "heartbeat", _LENGTH_DELIMITED)
_SEQ = _key(v1.Heartbeat, "seq", _VARINT)
_SENT_AT = _key(v1.Heartbeat, "sent_at_ms", _VARINT)
_ACK = _key(v1.CoordinatorMessage, "heartbeat_ack", _LENGTH_DELIMITED)
_ACK_SEQ = _key(v1.HeartbeatAck, "seq", _VARINT)
assert len(_SEQ) == len(_SENT_AT) == 1, "one-byte keys are what plain_heartbeat compares"
_SEQ_BYTE, _SENT_AT_BYTE = _SEQ[0], _SENT_AT[0]


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """The varint at ``data[at:]`` and where it ends (the bounded decoder's reading); a value of
    -1 when it runs past the end or is longer than :data:`_MAX_VARINT_BYTES`."""
    try:
        value, end = read_varint(data, at)
    except ValueError:
        return -1, len(data)
    return (-1, len(data)) if end - at > _MAX_VARINT_BYTES else (value, end)


def plain_heartbeat(data: bytes) -> int | None:
    """The ``seq`` of ``data`` when it is a NodeMessage holding only a plain Heartbeat (see the
    module's rules); ``None`` for anything that must be decoded in full."""
    if not data.startswith(_HEARTBEAT):
        return None
    end = len(data)
    length, at = _varint(data, len(_HEARTBEAT))
    if length < 0 or at + length != end:
        return None
    seq = 0
    while at < end:
        key = data[at]
        if key != _SEQ_BYTE and key != _SENT_AT_BYTE:
            return None
        value, at = _varint(data, at + 1)
        if value < 0:
            return None
        if key == _SEQ_BYTE:
            seq = value
    return seq


def heartbeat_ack(seq: int) -> bytes:
    """The encoded CoordinatorMessage acking Heartbeat ``seq`` (0 <= seq < 2**64)."""
    # proto3 leaves a zero out; betterproto writes the empty HeartbeatAck as a length of 0.
    body = _ACK_SEQ + encode_varint(seq) if seq else b""
    return _ACK + encode_varint(len(body)) + body
