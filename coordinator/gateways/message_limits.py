"""Bounds on every incoming gRPC message, and the worker threads and processes that keep large
ones off the event loop.

Rules:
- A message's size is read from its 5-byte gRPC prefix and refused (RESOURCE_EXHAUSTED, naming
  the limit and its setting) before its body is read; grpclib's flow control then never lets the
  sender push more than one window of it. The body is then decoded within its other bounds
  (:mod:`~tuneplane.coordinator.gateways.bounded_decode`: counts and field sizes on raw bytes).
- A body larger than :data:`INLINE_DECODE_BYTES` is decoded in a worker thread, so no request
  holds the event loop for more than a few milliseconds. At most :data:`DECODE_THREADS`
  threads work at once, whatever the number of callers (:func:`in_thread`).
- Work on a large body that would hold the interpreter for long single calls (reading a JobSpec
  of megabytes: JSON, base64, canonical JSON) runs in at most :data:`HEAVY_PROCESSES` worker
  processes (:func:`in_process`); a worker thread would still stall the loop, as a C call keeps
  the interpreter lock for its whole length.

grpclib has no hook between the length prefix and the body, so :func:`bounded_handlers` wraps each
handler and gives its stream a ``recv_message`` that reads through grpclib's transport stream
(``stream._stream``, grpclib 0.4): with a client's reads (:mod:`tuneplane.agent.grpc_limits`,
which also holds the size rule both apply), the one place that knows grpclib's internals.
grpclib's ``RecvMessage`` event is not dispatched for these reads; nothing in TunePlane listens
to it.
"""

from __future__ import annotations

import contextlib
import functools
import struct
import sys
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, TypeVar, TypeVarTuple

import anyio
import anyio.to_process
import betterproto
from anyio.lowlevel import RunVar
from grpclib import GRPCError
from grpclib.const import Handler, Status

from tuneplane.agent.grpc_limits import refuse_size

from .bounded_decode import decode, field_numbers

M = TypeVar("M", bound=betterproto.Message)
T = TypeVar("T")
Args = TypeVarTuple("Args")

# Decoding costs about 1.5 ms per KiB of small fields (measured): 2 KiB inline is ~3 ms.
INLINE_DECODE_BYTES = 2 * 1024
# The longest status message sent back; a longer one is cut (see shortened).
MAX_STATUS_MESSAGE_CHARS = 1024
# Worker threads decoding or checking bodies at once, and worker processes for the heaviest
# bodies: 50 hostile callers wait their turn instead of making 50 threads or processes.
DECODE_THREADS = 4
HEAVY_PROCESSES = 2
# Text (a JobSpec's JSON) longer than this is read in a worker process: a thread would hold the
# interpreter lock through each long C call (json, base64) of reading it.
PROCESS_TEXT_CHARS = 256 * 1024

# While a worker thread works on a large body, the interpreter hands its lock between threads
# every 0.5 ms instead of Python's 5 ms: a thread running Python code (betterproto decoding,
# grouping points) otherwise keeps the event loop waiting up to 5 ms each time the loop wants the
# lock back. Measured with the loop-lag bench: Ship of 5,000 points 10.5-12.6 ms median at 5 ms,
# 2.5-7.6 at 0.5 ms; Enroll 5.7-8.2 against 2.1-4.3. Only while such work is in flight: set for
# good, it cost 15-20% of admissions per second (157-170/s against 204-214/s, one in flight).
HEAVY_SWITCH_INTERVAL_S = 0.0005
_switching = {"heavy": 0, "saved": 0.0}

_THREADS: RunVar[anyio.CapacityLimiter] = RunVar("tuneplane_decode_threads")
_PROCESSES: RunVar[anyio.CapacityLimiter] = RunVar("tuneplane_heavy_processes")


def _limiter(var: RunVar[anyio.CapacityLimiter], tokens: int) -> anyio.CapacityLimiter:
    """The event loop's own limiter (a limiter belongs to the loop that first waits on it)."""
    try:
        return var.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(tokens)
        var.set(limiter)
        return limiter


@contextlib.contextmanager
def _fast_switching() -> Iterator[None]:
    """:data:`HEAVY_SWITCH_INTERVAL_S` while at least one such block runs (event loop only)."""
    if _switching["heavy"] == 0:
        _switching["saved"] = sys.getswitchinterval()
        sys.setswitchinterval(HEAVY_SWITCH_INTERVAL_S)
    _switching["heavy"] += 1
    try:
        yield
    finally:
        _switching["heavy"] -= 1
        if _switching["heavy"] == 0:
            sys.setswitchinterval(_switching["saved"])


async def in_thread(func: Callable[[*Args], T], *args: *Args) -> T:
    """``func(*args)`` in one of at most :data:`DECODE_THREADS` worker threads, with the
    interpreter switching threads every :data:`HEAVY_SWITCH_INTERVAL_S` meanwhile."""
    with _fast_switching():
        return await anyio.to_thread.run_sync(
            func, *args, limiter=_limiter(_THREADS, DECODE_THREADS)
        )


async def in_process(func: Callable[[*Args], T], *args: *Args) -> T:
    """``func(*args)`` in one of at most :data:`HEAVY_PROCESSES` worker processes.

    ``func`` must be a module-level function; arguments and result are pickled, so pass bytes
    rather than big strings (a str is UTF-8 encoded on the event loop as it is pickled).
    """
    return await anyio.to_process.run_sync(
        func, *args, limiter=_limiter(_PROCESSES, HEAVY_PROCESSES)
    )


async def read_bounded(stream: Any, message_type: type[M], limit: int, setting: str) -> M | None:
    """grpclib's ``recv_message`` with the size checked before the body is read.

    ``stream`` is a grpclib server stream; ``None`` means the client ended its side.
    """
    transport = stream._stream  # grpclib 0.4: the HTTP/2 stream behind the gRPC stream
    prefix = await transport.recv_data(5)
    if not prefix:
        return None
    compressed, length = struct.unpack(">?I", prefix)
    if compressed:
        raise GRPCError(
            Status.UNIMPLEMENTED,
            f"The {message_type.__name__} message is compressed; TunePlane accepts only "
            "uncompressed messages. Turn compression off in the client.",
        )
    refuse_size(length, limit, setting, message_type.__name__)
    data = await transport.recv_data(length)
    if len(data) < length:
        raise GRPCError(
            Status.INVALID_ARGUMENT,
            f"The {message_type.__name__} message ended after {len(data)} of its {length} bytes.",
        )
    if length <= INLINE_DECODE_BYTES:
        return decode(data, message_type)
    return await in_thread(decode, data, message_type)


def encode_with(message: betterproto.Message, field: str, value: bytes) -> bytes:
    """``message`` encoded with the bytes or string field ``field`` set to ``value`` (UTF-8 for a
    string), without building the field in Python: one copy of ``value``. ``field`` must be
    unset in ``message`` (protobuf reads fields in any order)."""
    number = field_numbers(type(message), field)[0]
    key = betterproto.encode_varint(number << 3 | 2)
    return b"".join((bytes(message), key, betterproto.encode_varint(len(value)), value))


async def encoded_off_loop(message: M, size: int) -> M:
    """``message``, encoded in a worker thread first when ``size`` (its large field's length)
    is over :data:`INLINE_DECODE_BYTES`: grpclib would otherwise encode it on the event loop."""
    if size <= INLINE_DECODE_BYTES:
        return message
    return pre_encoded(message, await in_thread(bytes, message))


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
        # An instance attribute shadows grpclib's method for this one call.
        stream.recv_message = functools.partial(read_bounded, stream, request_type, limit, setting)
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
