"""The Control service's calls from the Node: Enroll, and the Connect stream it holds open.

Part of the agent's adapter layer (with :mod:`.adapter`, :mod:`.wire` and :mod:`.wire_convert`):
every grpclib call here runs through :func:`tuneplane.agent.adapter.run_aio`, its exceptions are
translated once (:func:`.wire.translated`), and what it sends and receives are the agent's own
messages (:mod:`.wire_convert`).

Rules: a unary call has a 10 s deadline; leaving a Connect stream always resets it and closes the
connection, shielded and bounded, so nothing waits on a peer that may be gone.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import attrs
import trio
from grpclib.client import Channel
from grpclib.const import Cardinality

from tuneplane.proto import v1
from tuneplane.proto.contract import control_protocol

from . import messages as m
from .adapter import run_aio
from .grpc_limits import AGENT_RECEIVE_BYTES, guard_client_reads
from .inventory import Inventory
from .wire import (
    CONNECT_DEADLINE_S,
    UNARY_DEADLINE_S,
    CoordinatorBusy,
    Endpoint,
    Refused,
    WireError,
    aio_channel,
    client_tls,
    translated,
)
from .wire_convert import from_wire, inventory_to_wire, to_wire

CONNECT_METHOD = "/tuneplane.v1.Control/Connect"
ENROLL_METHOD = "/tuneplane.v1.Control/Enroll"


def connect_metadata(
    credential: str, capabilities: tuple[str, ...] = control_protocol.AGENT_CAPABILITIES
) -> dict[str, str]:
    """Connect's request metadata: the credential, and this agent's release, control protocol
    and ``capabilities``, so a coordinator can refuse an agent outside the version-skew policy
    before any Hello (and answer :func:`control_refusal`'s probe with that sentence), or put it
    in line in a reconnect storm."""
    said = {
        "authorization": f"Bearer {credential}",
        control_protocol.PROTOCOL_HEADER: str(control_protocol.PROTOCOL),
        control_protocol.VERSION_HEADER: control_protocol.release(),
    }
    if capabilities:
        said[control_protocol.CAPABILITIES_HEADER] = ",".join(capabilities)
    return said


@attrs.frozen
class Enrolled:
    node_id: str
    fleet: str
    node_credential: str = attrs.field(repr=False)
    credential_issued_at_ms: int = 0
    credential_expires_at_ms: int = 0


async def enroll(
    endpoint: Endpoint, ca_path: Path, join_token: str, inventory: Inventory, node_id: str = ""
) -> Enrolled:
    """Trade a one-time join token for a node id and control credential (unary, 10 s deadline).

    ``node_id`` re-enrolls that existing Node (same id, journal and members) instead.
    """
    ctx = client_tls(ca_path)
    request = v1.EnrollRequest(
        join_token=join_token,
        hostname=inventory.hostname,
        inventory=inventory_to_wire(inventory),
        node_id=node_id,
    )
    with translated(endpoint, ca_path, "Enroll"):
        channel = await run_aio(aio_channel, endpoint, ctx)
        try:
            with trio.fail_after(UNARY_DEADLINE_S + 1):
                reply = await run_aio(
                    v1.ControlStub(channel, timeout=UNARY_DEADLINE_S).enroll, request
                )
        finally:
            channel.close()
    return Enrolled(
        reply.node_id,
        reply.fleet,
        reply.node_credential,
        reply.credential_issued_at_ms,
        reply.credential_expires_at_ms,
    )


class ControlStream:
    """One open ``Connect`` stream. ``send`` and ``receive`` may run in two tasks at once."""

    def __init__(self, stream: Any, endpoint: Endpoint, ca_path: Path) -> None:
        self._stream = stream
        self._endpoint = endpoint
        self._ca_path = ca_path
        self._send_lock = trio.Lock()
        self._answered = False
        # A message over the limit is refused from its length prefix, before it is read.
        guard_client_reads(stream, AGENT_RECEIVE_BYTES, "CoordinatorMessage")

    async def send(self, msg: m.Outgoing) -> None:
        async with self._send_lock:
            with translated(self._endpoint, self._ca_path, "Connect"):
                await run_aio(self._stream.send_message, to_wire(msg))

    async def receive(self) -> m.Incoming | None:
        """The next message, or ``None`` when the coordinator ended the stream. The first call
        reads the answer's initial metadata: a busy refusal is :class:`~.wire.CoordinatorBusy`,
        a place in line is :class:`~.messages.Queued` (the Welcome follows)."""
        with translated(self._endpoint, self._ca_path, "Connect"):
            if not self._answered:
                await run_aio(self._stream.recv_initial_metadata)
                self._answered = True
                metadata = self._stream.initial_metadata or {}
                self._raise_if_busy(metadata)
                wait_s = control_protocol.queued_for(metadata)
                if wait_s is not None:
                    return m.Queued(wait_s, str(metadata[control_protocol.QUEUED_HEADER]))
            raw = await run_aio(self._stream.recv_message)
        return None if raw is None else from_wire(raw)

    def _raise_if_busy(self, metadata: Mapping[str, str]) -> None:
        said = metadata.get(control_protocol.BUSY_HEADER)
        if said is None:
            return
        raise CoordinatorBusy(
            f"The coordinator at {self._endpoint} cannot take this Node now (busy): {said}.",
            control_protocol.come_back_in(metadata),
        )


async def control_refusal(endpoint: Endpoint, ca_path: Path, credential: str) -> Refused | None:
    """Why the coordinator refuses ``credential`` on Connect, or None when it does not.

    A refusal that races with the stream reset reaches a live session as a bare reset. This
    opens Connect and ends it at once, sending no Hello: a refused credential, or an agent
    outside the version-skew policy (said in the request metadata), is answered with its status
    and sentence; an accepted one only with "no Hello", so no session starts.
    """
    ctx = client_tls(ca_path)
    try:
        with translated(endpoint, ca_path, "Connect"):
            channel = await run_aio(aio_channel, endpoint, ctx)
    except WireError:
        return None
    try:
        with trio.fail_after(UNARY_DEADLINE_S), translated(endpoint, ca_path, "Connect"):
            await run_aio(_probe_connect, channel, credential)
    except Refused as exc:
        if exc.status in ("UNAUTHENTICATED", "PERMISSION_DENIED", "FAILED_PRECONDITION"):
            return exc
    except (WireError, trio.TooSlowError):
        # A coordinator that accepts the connection but does not answer (paused, overloaded)
        # refused nothing: the connect loop moves on to the next coordinator.
        pass
    finally:
        channel.close()
    return None


async def _probe_connect(channel: Channel, credential: str) -> None:
    async with channel.request(
        CONNECT_METHOD,
        Cardinality.STREAM_STREAM,
        v1.NodeMessage,
        v1.CoordinatorMessage,
        # No capabilities: a probe is never put in line, it is answered (or refused) at once.
        metadata=connect_metadata(credential, ()),
    ) as stream:
        await stream.send_request(end=True)
        await stream.recv_message()


@asynccontextmanager
async def open_control_stream(
    endpoint: Endpoint, ca_path: Path, credential: str
) -> AsyncIterator[ControlStream]:
    """Open ``Connect`` with the Node's credential; the stream is reset when the block exits."""
    ctx = client_tls(ca_path)
    with translated(endpoint, ca_path, "Connect"):
        channel = await run_aio(aio_channel, endpoint, ctx)
    stream = channel.request(
        CONNECT_METHOD,
        Cardinality.STREAM_STREAM,
        v1.NodeMessage,
        v1.CoordinatorMessage,
        metadata=connect_metadata(credential),
    )
    try:
        # Connecting (TCP, TLS, HTTP/2) and opening the stream are bounded together: a
        # coordinator that accepts but never answers (paused, hung) must not hold the Node,
        # which has other coordinators to try.
        with translated(endpoint, ca_path, "Connect"), trio.fail_after(CONNECT_DEADLINE_S):
            await run_aio(stream.__aenter__)
            await run_aio(stream.send_request)
        yield ControlStream(stream, endpoint, ca_path)
    finally:
        # Leaving always resets the stream (an exception tells grpclib not to wait for trailers
        # from a peer that may be gone) and closes the connection; nothing here may block long.
        with trio.CancelScope(shield=True), trio.move_on_after(2):
            closing = ConnectionResetError("the agent closed the control stream")
            with suppress(Exception):
                await run_aio(stream.__aexit__, ConnectionResetError, closing, None)
        channel.close()
