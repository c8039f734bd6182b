"""Decoding one incoming message within its bounds: counts and field sizes read on the raw
bytes first, then betterproto, then the string checks.

Rules:
- Every string or bytes field is at most :data:`MAX_FIELD_BYTES`, checked on the raw bytes
  before decoding (:func:`check_field_sizes`), except the few fields that carry a JobSpec
  (:data:`LARGE_FIELDS`): a run id of 11 MB is refused without ever becoming a Python string, as
  building one in a worker thread holds the interpreter lock, and so the event loop, for
  milliseconds.
- Repeated fields that cost decoding time per entry (an inventory's GPUs, a Ship batch's points)
  are counted on the raw bytes, stopping at the bound, before betterproto sees them
  (:data:`COUNT_RULES`).
- Every decoded string is then checked
  (:func:`~tuneplane.proto.contract.input_checks.check_message`).
- Bytes that are not the message they claim to be are INVALID_ARGUMENT, never an unknown error.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import betterproto
from grpclib import GRPCError
from grpclib.const import Status

from tuneplane.proto import v1
from tuneplane.proto.contract.input_checks import InputRefused, check_message
from tuneplane.proto.varint import read_varint

M = TypeVar("M", bound=betterproto.Message)

# The fewest bytes one entry of a counted repeated field takes on the wire: its tag and length.
ENTRY_BYTES = 2
# Fields looked at per message level while counting; more is refused outright.
MAX_SCANNED_FIELDS = 20_000
MAX_INVENTORY_GPUS = 256
MAX_HELD_MEMBERS = 4096
MAX_SHIP_POINTS = 5000
MAX_SHIP_STRINGS = 20_000
# Restart marks, and hparams records, in one Ship (the gateway also bounds the two together).
MAX_SHIP_MARKS = 1000
# The longest string or bytes field outside LARGE_FIELDS. A log chunk is 64 KiB (logship), a
# Ship batch's widest column 5,000 x 8 bytes; nothing else comes close.
MAX_FIELD_BYTES = 256 * 1024


class TooMany(ValueError):
    """A repeated field holds more entries than its bound (or a level has too many fields)."""


def field_numbers(cls: type[betterproto.Message], dotted: str) -> tuple[int, ...]:
    """Field numbers along ``dotted`` (``"inventory.gpus"``), read from the generated classes."""
    numbers = []
    current: Any = cls  # betterproto types its per-class metadata too loosely for mypy
    for name in dotted.split("."):
        info = current._betterproto
        numbers.append(info.meta_by_field_name[name].number)
        current = info.cls_by_field.get(name, current)
    return tuple(numbers)


def _rules(
    cls: type[betterproto.Message], *rules: tuple[str, int]
) -> tuple[tuple[str, tuple[int, ...], int], ...]:
    return tuple((dotted, field_numbers(cls, dotted), bound) for dotted, bound in rules)


# Message type -> (field path, field numbers, most entries). A path counts across every copy of
# each message on the way (protobuf merges repeated copies of a singular message field).
COUNT_RULES: Mapping[type[betterproto.Message], tuple[tuple[str, tuple[int, ...], int], ...]] = {
    v1.EnrollRequest: _rules(v1.EnrollRequest, ("inventory.gpus", MAX_INVENTORY_GPUS)),
    v1.NodeMessage: _rules(
        v1.NodeMessage,
        ("hello.inventory.gpus", MAX_INVENTORY_GPUS),
        ("hello.held", MAX_HELD_MEMBERS),
        ("heartbeat.inventory.gpus", MAX_INVENTORY_GPUS),
    ),
    v1.ShipRequest: _rules(
        v1.ShipRequest,
        ("points", MAX_SHIP_POINTS),
        ("columns.strings", MAX_SHIP_STRINGS),
        ("restarts", MAX_SHIP_MARKS),
        ("hparams", MAX_SHIP_MARKS),
    ),
}


# Message type -> field paths (as field numbers) that may be longer than MAX_FIELD_BYTES: the
# JobSpec of a Preview, bounded only by the listener's message size.
LARGE_FIELDS: Mapping[type[betterproto.Message], frozenset[tuple[int, ...]]] = {
    v1.PreviewRequest: frozenset({field_numbers(v1.PreviewRequest, "jobspec_json")}),
}


class FieldTooLarge(ValueError):
    """A string or bytes field is longer than :data:`MAX_FIELD_BYTES`."""


@functools.cache
def _field_table(
    cls: type[betterproto.Message],
) -> dict[int, tuple[str, type[betterproto.Message] | None]]:
    """Field number -> (name, message class of a message field, or None for a scalar)."""
    current: Any = cls  # betterproto types its per-class metadata too loosely for mypy
    info = current._betterproto
    table: dict[int, tuple[str, type[betterproto.Message] | None]] = {}
    for name, meta in info.meta_by_field_name.items():
        sub = info.cls_by_field.get(name) if meta.proto_type == "message" else None
        table[meta.number] = (name, sub)
    return table


def check_field_sizes(
    data: bytes | memoryview,
    message_type: type[betterproto.Message],
    large: frozenset[tuple[int, ...]] = frozenset(),
    path: tuple[int, ...] = (),
    where: str = "",
) -> None:
    """Raise :class:`FieldTooLarge` naming the first field over :data:`MAX_FIELD_BYTES`.

    Only fields longer than the bound are looked into, so a message of small fields costs one
    pass over its top level. A field number the message does not declare is bounded too.
    """
    table = _field_table(message_type)
    for number, payload in _fields(data):
        if payload is None or len(payload) <= MAX_FIELD_BYTES:
            continue
        at = (*path, number)
        if at in large:
            continue
        name, sub = table.get(number, (f"<field {number}>", None))
        dotted = f"{where or message_type.__name__}.{name}"
        if sub is not None:
            check_field_sizes(payload, sub, large, at, dotted)
            continue
        raise FieldTooLarge(
            f"{dotted} is {len(payload)} bytes, more than the {MAX_FIELD_BYTES} bytes TunePlane "
            "accepts in that field. Send a shorter value."
        )


def _fields(data: bytes | memoryview) -> Iterable[tuple[int, memoryview | None]]:
    """(field number, payload of a length-delimited field or None), at most MAX_SCANNED_FIELDS."""
    view = memoryview(data)
    pos = 0
    seen = 0
    while pos < len(view):
        seen += 1
        if seen > MAX_SCANNED_FIELDS:
            raise TooMany(f"holds more than {MAX_SCANNED_FIELDS} fields at one level")
        key, pos = read_varint(view, pos)
        number, kind = key >> 3, key & 7
        if kind == 0:
            _, pos = read_varint(view, pos)
            yield number, None
        elif kind == 1:
            pos += 8
            yield number, None
        elif kind == 5:
            pos += 4
            yield number, None
        elif kind == 2:
            length, pos = read_varint(view, pos)
            if pos + length > len(view):
                raise ValueError("a length-delimited field runs past the end of the message")
            yield number, view[pos : pos + length]
            pos += length
        else:
            raise ValueError(f"wire type {kind} (groups) is not used by TunePlane")
        if pos > len(view):
            raise ValueError("a field runs past the end of the message")


def count_field(data: bytes | memoryview, numbers: tuple[int, ...], bound: int) -> int:
    """How many entries the field at ``numbers`` holds, counting no further than ``bound + 1``."""
    total = 0
    head, rest = numbers[0], numbers[1:]
    for number, payload in _fields(data):
        if number != head:
            continue
        if not rest:
            total += 1
        elif payload is not None:
            total += count_field(payload, rest, bound - total)
        if total > bound:
            break
    return total


def check_counts(data: bytes | memoryview, message_type: type[betterproto.Message]) -> None:
    """Raise :class:`TooMany` when a bounded repeated field of ``data`` holds too many entries.

    Every entry of a counted field takes at least two bytes (its tag and its length), so a
    message shorter than ``2 * (bound + 1)`` bytes cannot break that bound and is not walked:
    a Hello or a Heartbeat (hundreds of bytes) costs nothing here."""
    for dotted, numbers, bound in COUNT_RULES.get(message_type, ()):
        if len(data) < ENTRY_BYTES * (bound + 1):
            continue
        if count_field(data, numbers, bound) > bound:
            raise TooMany(f"{message_type.__name__}.{dotted} holds more than {bound} entries")


def decode(data: bytes, message_type: type[M]) -> M:
    """Counts, then betterproto, then the string checks: a message, or a GRPCError.

    Only two status codes leave here: RESOURCE_EXHAUSTED (too many entries, a field too long)
    and INVALID_ARGUMENT
    (not a valid message, or a string with a NUL), each with a sentence.
    """
    name = message_type.__name__
    try:
        if len(data) > MAX_FIELD_BYTES:
            check_field_sizes(data, message_type, LARGE_FIELDS.get(message_type, frozenset()))
        check_counts(data, message_type)
    except FieldTooLarge as exc:
        raise GRPCError(Status.RESOURCE_EXHAUSTED, str(exc)) from None
    except TooMany as exc:
        raise GRPCError(
            Status.RESOURCE_EXHAUSTED, f"{exc}; that is more than TunePlane accepts. Send less."
        ) from None
    except ValueError as exc:
        raise GRPCError(
            Status.INVALID_ARGUMENT, f"The {name} message is not valid protobuf ({exc})."
        ) from None
    try:
        message = message_type().parse(data)
    except Exception as exc:  # betterproto raises many types on bad bytes; all mean "not valid"
        raise GRPCError(
            Status.INVALID_ARGUMENT,
            f"The {name} message cannot be decoded ({type(exc).__name__}); send a valid {name}.",
        ) from None
    try:
        check_message(message)
    except InputRefused as exc:
        raise GRPCError(Status.INVALID_ARGUMENT, str(exc)) from None
    return message
