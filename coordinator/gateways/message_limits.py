"""Bounds on every incoming gRPC message, checked on raw bytes before anything is decoded.

Rules:
- A message's size is read from its 5-byte gRPC prefix and refused (RESOURCE_EXHAUSTED, naming
  the limit and its setting) before its body is read; grpclib's flow control then never lets the
  sender push more than one window of it. The body is then decoded within its other bounds
  (:mod:`~tuneplane.coordinator.gateways.bounded_decode`: counts and field sizes on raw bytes).
- A body larger than :data:`INLINE_DECODE_BYTES` is decoded in a worker thread
  (:func:`~tuneplane.coordinator.offload.in_thread`), so no request holds the event loop for
  more than a few milliseconds.

grpclib has no hook between the length prefix and the body, so :func:`bounded_handlers` wraps each
handler and gives its stream a ``recv_message`` that reads through grpclib's transport stream
(``stream._stream``, grpclib 0.4), and a ``recv_encoded`` that stops before decoding (the control
stream reads a plain Heartbeat by its layout). :func:`send_encoded` writes an encoded message the
same way. With a client's reads (:mod:`tuneplane.agent.grpc_limits`, which also holds the size
rule both apply), this is the one place that knows grpclib's internals. grpclib's
``RecvMessage`` and ``SendMessage`` events are not dispatched for these reads and writes;
nothing in TunePlane listens to them.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Awaitable, Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import betterproto
from grpclib import GRPCError
from grpclib.const import Handler, Status

from tuneplane.agent.grpc_limits import refuse_size

from ..offload import in_thread
from .bounded_decode import decode, field_numbers

M = TypeVar("M", bound=betterproto.Message)
T = TypeVar("T")

# The gRPC message prefix: compressed flag, then the length (big-endian).
_PREFIX = struct.Struct(">?I")

# Decoding costs about 1.5 ms per KiB of small fields (measured): 2 KiB inline is ~3 ms.
INLINE_DECODE_BYTES = 2 * 1024
# The longest status message sent back; a longer one is cut (see shortened).
MAX_STATUS_MESSAGE_CHARS = 1024


async def read_bounded(stream: Any, message_type: type[M], limit: int, setting: str) -> M | None:
    """grpclib's ``recv_message`` with the size checked before the body is read.

    ``stream`` is a grpclib server stream; ``None`` means the client ended its side.
    """
    data = await read_bounded_bytes(stream, message_type, limit, setting)
    return None if data is None else await decoded(data, message_type)


async def read_bounded_bytes(
    stream: Any, message_type: type[betterproto.Message], limit: int, setting: str
) -> bytes | None:
    """The next message's body, not decoded, its size checked before it is read; ``None``
    when the client ended its side. Decode it with :func:`decoded`."""
    transport = stream._stream  # grpclib 0.4: the HTTP/2 stream behind the gRPC stream
    prefix = await transport.recv_data(5)
    if not prefix:
        return None
    compressed, length = _PREFIX.unpack(prefix)
    if compressed:
        raise GRPCError(
            Status.UNIMPLEMENTED,
            f"The {message_type.__name__} message is compressed; TunePlane accepts only "
            "uncompressed messages. Turn compression off in the client.",
        )
    refuse_size(length, limit, setting, message_type.__name__)
    data: bytes = await transport.recv_data(length)
    if len(data) < length:
        raise GRPCError(
            Status.INVALID_ARGUMENT,
            f"The {message_type.__name__} message ended after {len(data)} of its {length} bytes.",
        )
    return data


async def decoded(data: bytes, message_type: type[M]) -> M:
    """``data`` decoded within its bounds (a GRPCError when it breaks one), in a worker thread
    when it is larger than :data:`INLINE_DECODE_BYTES`."""
    if len(data) <= INLINE_DECODE_BYTES:
        return decode(data, message_type)
    return await in_thread(decode, data, message_type)


async def send_encoded(stream: Any, data: bytes) -> None:
    """Send ``data``, one message already encoded, on grpclib server ``stream`` once its
    initial metadata is out: framed and written as grpclib's ``send_message`` writes it, with no
    message built or encoded on the event loop."""
    assert stream._send_initial_metadata_done, "send the initial metadata first"
    await stream._stream.send_data(_PREFIX.pack(False, len(data)) + data)


async def encoded(message: betterproto.Message, size: int) -> bytes:
    """``message`` encoded, in a worker thread when ``size`` (its large field's length) is over
    :data:`INLINE_DECODE_BYTES`."""
    if size <= INLINE_DECODE_BYTES:
        return bytes(message)
    return await in_thread(bytes, message)


def encode_with(message: betterproto.Message, field: str, value: bytes) -> bytes:
    """``message`` encoded with the bytes or string field ``field`` set to ``value`` (UTF-8 for a
    string), without building the field in Python: one copy of ``value``. ``field`` must be
    unset in ``message`` (protobuf reads fields in any order)."""
    number = field_numbers(type(message), field)[0]
    key = betterproto.encode_varint(number << 3 | 2)
    return b"".join((bytes(message), key, betterproto.encode_varint(len(value)), value))


def pre_encoded(message: M, data: bytes) -> M:
    """``message``, which grpclib will send as ``data`` (the message encoded in a worker).

    grpclib's codec calls ``SerializeToString`` on the event loop; encoding 11 MiB there holds
    the loop for about 15 ms, so a large reply is encoded off the loop and handed over whole.
    """
    object.__setattr__(message, "SerializeToString", lambda: data)
    return message


def bounded_handlers(
    services: Iterable[Any],
    limits: Mapping[str, tuple[int, str]],
    default: tuple[int, str],
    errors: Callable[[], AbstractContextManager[None]],
) -> list[Any]:
    """``services`` with every handler reading through :func:`read_bounded`.

    ``limits`` maps a method path (``/tuneplane.v1.Control/Enroll``) to (bytes, setting name);
    other methods get ``default``. ``errors`` is the wire edge's exception translator, entered
    around every handler so no exception leaves as grpclib's bare "Internal Server Error".
    """
    wrapped = []
    for service in services:
        mapping = {
            path: Handler(
                _guard(handler.func, handler.request_type, *limits.get(path, default), errors),
                handler.cardinality,
                handler.request_type,
                handler.reply_type,
            )
            for path, handler in service.__mapping__().items()
        }
        wrapped.append(_Service(mapping))
    return wrapped


class _Service:
    def __init__(self, mapping: dict[str, Handler]) -> None:
        self._mapping = mapping

    def __mapping__(self) -> dict[str, Handler]:
        return self._mapping


def _guard(
    func: Callable[[Any], Awaitable[None]],
    request_type: type[betterproto.Message],
    limit: int,
    setting: str,
    errors: Callable[[], AbstractContextManager[None]],
) -> Callable[[Any], Awaitable[None]]:
    async def guarded(stream: Any) -> None:
        # An instance attribute shadows grpclib's method for this one call; ``recv_encoded``
        # reads the same way and leaves the decoding to the handler.
        stream.recv_message = functools.partial(read_bounded, stream, request_type, limit, setting)
        stream.recv_encoded = functools.partial(
            read_bounded_bytes, stream, request_type, limit, setting
        )
        try:
            with errors():
                await func(stream)
        except GRPCError as exc:
            raise shortened(exc) from None

    return guarded


def shortened(exc: GRPCError) -> GRPCError:
    """``exc`` with its message cut to :data:`MAX_STATUS_MESSAGE_CHARS`.

    A refusal may quote what the caller sent (an unknown run id of 11 MB); grpclib sends the
    message as an HTTP/2 trailer, HPACK-encoded in Python on the event loop, which took 4.7 s
    for 300 KB and grows faster than the length.
    """
    message = exc.message
    if message is None or len(message) <= MAX_STATUS_MESSAGE_CHARS:
        return exc
    cut = message[: MAX_STATUS_MESSAGE_CHARS - 80]
    return GRPCError(
        exc.status, f"{cut}... (the message is {len(message)} characters; shortened)", exc.details
    )
