"""Bounds on gRPC messages a grpclib reader takes in: the size rule every reader applies, and
what a client (the Node) applies to the replies it reads.

Rules:
- :func:`refuse_size` is the one size rule: a message whose 5-byte gRPC prefix announces more
  than the limit is RESOURCE_EXHAUSTED, naming the limit and its setting, before its body is
  read. The coordinator's listeners apply it
  (:mod:`tuneplane.coordinator.gateways.message_limits`), and so does a Node's control stream
  (:func:`guard_client_reads`).
- A client decodes with :class:`ClientCodec`: bytes that are not the message they claim to be
  are INVALID_ARGUMENT with a sentence, never an exception from inside betterproto.
- Shared runtime infrastructure: it lives in the agent, the lowest layer the coordinator also
  imports. grpclib 0.4's transport stream (``stream._stream``) is reached here and in the
  coordinator's message_limits, nowhere else.
"""

from __future__ import annotations

from typing import Any

from grpclib import GRPCError
from grpclib.const import Status
from grpclib.encoding.proto import ProtoCodec

# What a Node accepts from the coordinator: a Prepare carries the JobSpec (experiment files up to
# 8 MiB, about 11 MiB in base64) and the sealed capsule.
AGENT_RECEIVE_BYTES = 32 * 1024 * 1024


def refuse_size(length: int, limit: int, setting: str, what: str) -> None:
    """RESOURCE_EXHAUSTED when a message announced as ``length`` bytes is over ``limit``."""
    if length > limit:
        raise GRPCError(
            Status.RESOURCE_EXHAUSTED,
            f"The {what} message is {length} bytes, over the limit of {limit} bytes "
            f"({setting}). Send a smaller message.",
        )


class ClientCodec(ProtoCodec):
    """grpclib's protobuf codec for a client (the agent), with bytes that are not the message
    they claim to be refused as INVALID_ARGUMENT instead of an exception from inside betterproto.

    Only parsing is checked here; what the message says is the receiver's to judge.
    """

    def decode(self, data: bytes, message_type: Any) -> Any:
        try:
            return super().decode(data, message_type)
        except Exception as exc:  # betterproto raises many types on bad bytes
            raise GRPCError(
                Status.INVALID_ARGUMENT,
                f"The {message_type.__name__} message cannot be decoded ({type(exc).__name__}).",
            ) from None


def guard_client_reads(stream: Any, limit: int, what: str) -> None:
    """On a grpclib *client* stream (after ``send_request``): refuse replies over ``limit``.

    grpclib reads a message as a 5-byte prefix, then one read of the announced length; a read
    longer than ``limit`` is therefore exactly a message over the limit.
    """
    transport = stream._stream  # grpclib 0.4
    read = transport.recv_data

    async def recv_data(size: int) -> bytes:
        refuse_size(size, limit, "the Node's receive limit", what)
        data: bytes = await read(size)
        return data

    transport.recv_data = recv_data
