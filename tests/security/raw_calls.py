"""Calls to a real coordinator with bytes chosen by the test, as an attacker sends them.

Rules: a real grpclib client over loopback TLS with the real CA; the only thing it changes is the
codec, which sends the test's bytes unchanged (a message of any size, invalid UTF-8, garbage).
asyncio code: tests call it through ``asyncio.run``.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import attrs
from grpclib import GRPCError
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.encoding.base import CodecBase
from grpclib.exceptions import StreamTerminatedError

from tests.coordinator.grpc_client import bearer
from tuneplane.agent.client_tls import grpc_client_context

CALL_TIMEOUT_S = 30.0


class RawCodec(CodecBase):
    """Sends ``bytes`` as they are and hands replies back undecoded."""

    __content_subtype__ = "proto"

    def encode(self, message: Any, message_type: Any) -> bytes:
        return message if isinstance(message, bytes) else bytes(message)

    def decode(self, data: bytes, message_type: Any) -> bytes:
        return data


@attrs.frozen
class Outcome:
    status: Status
    message: str
    seconds: float


def raw_channel(address: str, ca_path: Path) -> Channel:
    host, _, port = address.rpartition(":")
    return Channel(host, int(port), ssl=grpc_client_context(ca_path), codec=RawCodec())


async def call(
    address: str, ca_path: Path, method: str, body: bytes, token: str | None = None
) -> Outcome:
    """One unary call with ``body`` as the request; the status the coordinator answered.

    The clock starts once the body is ready, so ``seconds`` is how long the refusal took.
    """
    channel = raw_channel(address, ca_path)
    started = time.perf_counter()
    try:
        async with channel.request(
            method,
            Cardinality.UNARY_UNARY,
            bytes,
            bytes,
            metadata=bearer(token) if token else None,
            timeout=CALL_TIMEOUT_S,
        ) as stream:
            await stream.send_request()
            # The coordinator may refuse before reading it all: its status follows.
            with contextlib.suppress(StreamTerminatedError):
                await stream.send_message(body, end=True)
            await stream.recv_message()
            await stream.recv_trailing_metadata()
        return Outcome(Status.OK, "", time.perf_counter() - started)
    except GRPCError as exc:
        return Outcome(exc.status, exc.message or "", time.perf_counter() - started)
    finally:
        channel.close()


def frame(field_number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field (wire type 2), written by hand."""
    return _varint(field_number << 3 | 2) + _varint(len(payload)) + payload


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)
