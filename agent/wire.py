"""The wire edge: TLS, grpclib and betterproto, translated to the agent's own messages and errors.

Rules:
- The only agent module that talks to the coordinator over grpclib; besides it only the shared
  client helpers it uses (:mod:`.client_tls`, :mod:`.call_failure`, :mod:`.grpc_limits`) import
  grpclib. Server verification is always on (the CA from the Node's state dir), ALPN offers
  only h2, and a unary call has a 10 s deadline.
- Exceptions are translated once, here (:func:`_translated`), by the one table every client
  shares (:mod:`.call_failure`), into :class:`WireError` subclasses whose ``str()`` says what
  failed and how to fix it.
- grpclib is asyncio code: every call goes through :func:`tuneplane.agent.adapter.run_aio`.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from pathlib import Path
from typing import Any

import attrs
import betterproto
import trio
from grpclib.client import Channel
from grpclib.const import Cardinality

from tuneplane.proto import v1
from tuneplane.proto.contract.derivation_source import ManifestSummary
from tuneplane.proto.contract.input_checks import InputRefused, check_message

from . import messages as m
from .adapter import run_aio
from .call_failure import CALL_ERRORS, Kind, classify
from .client_tls import CaFileError, grpc_client_context
from .grpc_limits import AGENT_RECEIVE_BYTES, ClientCodec, guard_client_reads
from .host_port import join_host_port, split_host_port
from .inventory import Gpu, Inventory
from .journal import MemberKey
from .member_state import MemberState

UNARY_DEADLINE_S = 10.0
CONNECT_METHOD = "/tuneplane.v1.Control/Connect"
ENROLL_METHOD = "/tuneplane.v1.Control/Enroll"


class WireError(Exception):
    """Talking to the coordinator failed. ``str()`` is a sentence for the operator."""


class CoordinatorUnreachable(WireError):
    """No connection (refused, reset, timed out); worth retrying with backoff."""


class TlsVerificationFailed(WireError):
    """The coordinator's certificate does not verify against the CA file; retrying won't help."""


class Refused(WireError):
    """The coordinator answered and said no (bad token, unknown Node, revoked credential)."""

    def __init__(self, message: str, status: str) -> None:
        super().__init__(message)
        self.status = status


@attrs.frozen
class Endpoint:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        """Read ``HOST:PORT`` (``[::1]:PORT`` for IPv6). Raises :class:`ValueError` with the fix."""
        found = split_host_port(text)
        if found is None:
            raise ValueError(
                f"coordinator address {text!r} is not HOST:PORT; use the `control` address from "
                "the coordinator's endpoints.json, for example 127.0.0.1:7444."
            )
        return cls(*found)

    def __str__(self) -> str:
        return join_host_port(self.host, self.port)


def client_tls(ca_path: Path) -> ssl.SSLContext:
    """The one client TLS (:mod:`tuneplane.agent.client_tls`), a CA file it cannot load being a
    :class:`TlsVerificationFailed` (retrying won't help)."""
    try:
        return grpc_client_context(ca_path)
    except CaFileError as exc:
        raise TlsVerificationFailed(str(exc)) from None


@contextmanager
def _translated(endpoint: Endpoint, ca_path: Path, call: str) -> Iterator[None]:
    """Map what ``call`` raised to :class:`WireError` subclasses, once, at the edge, by the one
    table (:func:`tuneplane.agent.call_failure.classify`)."""
    try:
        yield
    except CALL_ERRORS as exc:
        failure = classify(exc)
        text = failure.sentence(
            f"the coordinator at {endpoint}",
            call,
            UNARY_DEADLINE_S,
            ca_path,
            "Pass the coordinator's own tls/ca.pem",
            "that node.json's coordinator names its control listener",
        )
        if failure.kind is Kind.REFUSED:
            raise Refused(text, failure.status) from None
        if failure.kind is Kind.UNVERIFIED:
            raise TlsVerificationFailed(text) from None
        raise CoordinatorUnreachable(text) from None


# --- conversion --------------------------------------------------------------------------------


def inventory_to_wire(inv: Inventory) -> v1.Inventory:
    return v1.Inventory(
        hostname=inv.hostname,
        cpu_count=inv.cpu_count,
        memory_bytes=inv.memory_bytes,
        gpus=[
            v1.Gpu(
                index=g.index,
                uuid=g.uuid,
                name=g.name,
                series=g.series,
                memory_bytes=g.memory_bytes,
                mig_enabled=g.mig_enabled,
                healthy=g.healthy,
                health_reason=g.health_reason,
            )
            for g in inv.gpus
        ],
        gpu_source=inv.gpu_source,
        driver_version=inv.driver_version,
        cuda_version=inv.cuda_version,
    )


def inventory_from_wire(inv: v1.Inventory) -> Inventory:
    gpus = tuple(
        Gpu(g.index, g.uuid, g.name, g.series, g.memory_bytes, g.mig_enabled, g.healthy,
            g.health_reason)
        for g in inv.gpus
    )  # fmt: skip
    return Inventory(
        inv.hostname, inv.cpu_count, inv.memory_bytes, gpus, inv.gpu_source,
        inv.driver_version, inv.cuda_version,
    )  # fmt: skip


def _ref(key: MemberKey) -> v1.MemberRef:
    return v1.MemberRef(run_id=key.run_id, attempt=key.attempt, member_index=key.member_index)


def _key(ref: v1.MemberRef) -> MemberKey:
    return MemberKey(ref.run_id, ref.attempt, ref.member_index)


def _state(state: MemberState) -> v1.MemberState:
    wire_state: v1.MemberState = v1.MemberState[state.name]
    return wire_state


def _rendezvous(r: v1.Rendezvous | None) -> m.Rendezvous | None:
    if r is None or not r.master_port:
        return None
    return m.Rendezvous(r.master_addr, r.master_port)


def _init_from_fetch(f: v1.InitFromFetch | None) -> m.InitFromFetch | None:
    if f is None or not f.address:
        return None
    return m.InitFromFetch(f.address, f.cert_sha256, f.grant, f.grant_expires_at_ms)


def to_wire(msg: m.Outgoing) -> v1.NodeMessage:
    """One outgoing domain message as the NodeMessage that carries it."""
    if isinstance(msg, m.Hello):
        held = [v1.HeldMember(member=_ref(k), state=_state(s)) for k, s in msg.held]
        hello = v1.NodeMessage(
            hello=v1.Hello(
                node_id=msg.node_id,
                agent_version=msg.agent_version,
                inventory=inventory_to_wire(msg.inventory),
                held=held,
                dialed_address=msg.dialed_address,
            )
        )
        if msg.outputs is not None:
            hello.hello.outputs = v1.OutputsService(
                address=msg.outputs.address,
                cert_sha256=msg.outputs.cert_sha256,
                grant_key=msg.outputs.grant_key,
            )
        return hello
    if isinstance(msg, m.Heartbeat):
        beat = v1.Heartbeat(seq=msg.seq, sent_at_ms=msg.sent_at_ms)
        if msg.inventory is not None:
            beat.inventory = inventory_to_wire(msg.inventory)
        return v1.NodeMessage(heartbeat=beat)
    if isinstance(msg, m.Report):
        r = msg.report
        exit = r.exit
        return v1.NodeMessage(
            report=v1.MemberReport(
                report_seq=r.report_seq,
                member=_ref(r.key),
                state=_state(r.state),
                at_ms=r.at_ms,
                reason=r.reason,
                has_exit=exit is not None,
                exit_code=(exit.exit_code or 0) if exit else 0,
                signal=(exit.signal or 0) if exit else 0,
                out_dir=r.out_dir,
                journal_id=r.journal_id,
                output_manifest=_manifest(r.manifest),
            )
        )
    if isinstance(msg, m.PrepareReply):
        reply = v1.PrepareReply(
            member=_ref(msg.key), ok=msg.ok, reason=msg.reason, rendezvous_held=msg.rendezvous_held
        )
        if msg.rendezvous is not None:
            reply.rendezvous = v1.Rendezvous(
                master_addr=msg.rendezvous.master_addr, master_port=msg.rendezvous.master_port
            )
        return v1.NodeMessage(prepare_reply=reply)
    if isinstance(msg, m.LogChunk):
        return v1.NodeMessage(
            log_chunk=v1.LogChunk(
                member=_ref(msg.key),
                stream=msg.stream,
                offset=msg.offset,
                data=msg.data,
                eof=msg.eof,
            )
        )
    if isinstance(msg, m.CredentialRenewal):
        return v1.NodeMessage(credential_renewal=v1.CredentialRenewal(request_id=msg.request_id))
    if isinstance(msg, m.CredentialStored):
        return v1.NodeMessage(credential_stored=v1.CredentialStored(request_id=msg.request_id))
    return v1.NodeMessage(decision_query=v1.DecisionQuery(member=_ref(msg.key)))


class UnknownMessage(WireError):
    """The coordinator sent a message this agent does not know (a newer protocol)."""


def _refuse_bad_text(msg: v1.CoordinatorMessage, body: object) -> None:
    """A field of the wrong type, or a NUL or lone surrogate in a string, is refused here.

    A Prepare's file names and JobSpec are Prepare's own to refuse (its PrepareReply says why
    and the Job is aborted); only the member it names must be usable to answer at all.
    """
    try:
        if isinstance(body, v1.Prepare):
            check_message(msg, text=False)
            check_message(body.member)
        else:
            check_message(msg)
    except InputRefused as exc:
        raise UnknownMessage(
            f"The coordinator sent a message this agent cannot use: {exc} The message is skipped."
        ) from None


def from_wire(msg: v1.CoordinatorMessage) -> m.Incoming:
    """The domain message carried by one CoordinatorMessage; :class:`UnknownMessage` if none."""
    name, body = betterproto.which_one_of(msg, "body")
    _refuse_bad_text(msg, body)
    if isinstance(body, v1.Welcome):
        return m.Welcome(
            body.heartbeat_interval_ms,
            body.heartbeat_timeout_ms,
            body.server_time_ms,
            body.credential_issued_at_ms,
            body.credential_expires_at_ms,
            body.control_address,
        )
    if isinstance(body, v1.ControlAddress):
        return m.ControlAddress(body.address)
    if isinstance(body, v1.HeartbeatAck):
        return m.HeartbeatAck(body.seq)
    if isinstance(body, v1.ReportAck):
        return m.ReportAck(body.report_seq, body.refused)
    if isinstance(body, v1.Prepare):
        return m.Prepare(
            key=_key(body.member),
            jobspec_json=body.jobspec_json,
            member_count=body.member_count,
            gpu_indexes=tuple(body.gpu_indexes),
            pick_rendezvous=body.pick_rendezvous,
            capsule_digests=dict(body.capsule_digests),
            capsule_files=dict(body.capsule_files),
            owner=body.owner,
            gpu_uuids=tuple(body.gpu_uuids),
            rendezvous_nonce=body.rendezvous_nonce,
            rendezvous=_rendezvous(body.rendezvous),
            init_from_fetch=_init_from_fetch(body.init_from_fetch),
        )
    if isinstance(body, v1.Commit):
        return m.Commit(
            _key(body.member),
            _rendezvous(body.rendezvous),
            collector_credential=body.collector_credential,
            telemetry_address=body.telemetry_address,
        )
    if isinstance(body, v1.Abort):
        return m.Abort(_key(body.member), body.reason)
    if isinstance(body, v1.Cancel):
        return m.Cancel(_key(body.member), body.reason, body.grace_period_s, body.declared_lost)
    if isinstance(body, v1.LogAck):
        return m.LogAck(_key(body.member), body.stream, body.offset, body.eof)
    if isinstance(body, v1.CredentialIssued):
        return m.CredentialIssued(
            body.request_id,
            body.node_credential,
            body.credential_issued_at_ms,
            body.credential_expires_at_ms,
        )
    raise UnknownMessage(
        f"The coordinator sent a message this agent does not understand ({name or 'empty'}); "
        "upgrade tuneplane-node to the coordinator's version."
    )


# --- calls -------------------------------------------------------------------------------------


@attrs.frozen
class Enrolled:
    node_id: str
    fleet: str
    node_credential: str = attrs.field(repr=False)
    credential_issued_at_ms: int = 0
    credential_expires_at_ms: int = 0


async def _aio_channel(endpoint: Endpoint, ctx: ssl.SSLContext) -> Channel:
    return Channel(endpoint.host, endpoint.port, ssl=ctx, codec=ClientCodec())


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
    with _translated(endpoint, ca_path, "Enroll"):
        channel = await run_aio(_aio_channel, endpoint, ctx)
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
        # A message over the limit is refused from its length prefix, before it is read.
        guard_client_reads(stream, AGENT_RECEIVE_BYTES, "CoordinatorMessage")

    async def send(self, msg: m.Outgoing) -> None:
        async with self._send_lock:
            with _translated(self._endpoint, self._ca_path, "Connect"):
                await run_aio(self._stream.send_message, to_wire(msg))

    async def receive(self) -> m.Incoming | None:
        """The next message, or ``None`` when the coordinator ended the stream."""
        with _translated(self._endpoint, self._ca_path, "Connect"):
            raw = await run_aio(self._stream.recv_message)
        return None if raw is None else from_wire(raw)


async def control_refusal(endpoint: Endpoint, ca_path: Path, credential: str) -> Refused | None:
    """Why the coordinator refuses ``credential`` on Connect, or None when it does not.

    A refusal that races with the stream reset reaches a live session as a bare reset. This
    opens Connect and ends it at once, sending no Hello: a refused credential is answered with
    its status and sentence; an accepted one only with "no Hello", so no session starts.
    """
    ctx = client_tls(ca_path)
    try:
        with _translated(endpoint, ca_path, "Connect"):
            channel = await run_aio(_aio_channel, endpoint, ctx)
    except WireError:
        return None
    try:
        with trio.fail_after(UNARY_DEADLINE_S), _translated(endpoint, ca_path, "Connect"):
            await run_aio(_probe_connect, channel, credential)
    except Refused as exc:
        if exc.status in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
            return exc
    except WireError:
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
        metadata={"authorization": f"Bearer {credential}"},
    ) as stream:
        await stream.send_request(end=True)
        await stream.recv_message()


@asynccontextmanager
async def open_control_stream(
    endpoint: Endpoint, ca_path: Path, credential: str
) -> AsyncIterator[ControlStream]:
    """Open ``Connect`` with the Node's credential; the stream is reset when the block exits."""
    ctx = client_tls(ca_path)
    with _translated(endpoint, ca_path, "Connect"):
        channel = await run_aio(_aio_channel, endpoint, ctx)
    stream = channel.request(
        CONNECT_METHOD,
        Cardinality.STREAM_STREAM,
        v1.NodeMessage,
        v1.CoordinatorMessage,
        metadata={"authorization": f"Bearer {credential}"},
    )
    try:
        with _translated(endpoint, ca_path, "Connect"):
            await run_aio(stream.__aenter__)
            with trio.fail_after(UNARY_DEADLINE_S):
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


def _manifest(text: str) -> v1.OutputManifest:
    """A report's output manifest summary (journaled JSON) on the wire; empty when it has none."""
    summary = ManifestSummary.from_json(text)
    if summary is None:
        return v1.OutputManifest()
    return v1.OutputManifest(
        files=summary.files, bytes=summary.bytes, sha256=summary.sha256, problem=summary.problem
    )
