"""The outputs listener: serve this Node's ended members' outputs to Nodes holding a grant.

Rules:
- Bound before the agent's Trio run (:func:`bind`): a port that cannot be held stops the agent
  at start with a sentence naming ``[outputs] listen``. Served in the daemon's nursery.
- TLS with the Node's own self-signed certificate (agent/outputs_identity.py), pinned by the
  fetching Node. Framing in agent/outputs_wire.py; every request is decided on its own:
  1. the grant must be the coordinator's (HMAC by this Node's grant key) for exactly the
     requested member and not expired, checked before anything is read;
  2. this Node's journal (read through the adapter, agent/journal.py) must hold that member as
     exited, with exactly the requested output directory;
  3. ``manifest`` serves ``<out_dir>.manifest.json``; ``file`` serves a path only when that
     manifest lists it, as a regular file inside ``out_dir`` (no link out, no final link).
  Anything else gets an error frame with a sentence and the connection is closed.
- Bounded: :data:`MAX_CONNECTIONS` at once (more are closed at once), request headers by
  agent/outputs_wire.py, and every read or write of a connection by :data:`IDLE_S`.
- Logged as ``outputs served`` / ``outputs refused`` lines with the member, what and the peer.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import BinaryIO

import attrs
import trio

from tuneplane.proto.contract.derivation_source import manifest_path
from tuneplane.proto.contract.outputs_grant import grant_valid

from . import outputs_wire as ow
from .config import OutputsSettings
from .host_port import join_host_port
from .init_from import SourceUnreadable, open_source_file, read_manifest_file
from .journal_records import MemberKey, MemberRecord
from .member_state import MemberState
from .messages import OutputsService
from .outputs_identity import OutputsIdentity
from .outputs_manifest import CHUNK_BYTES, ManifestProblem, read_manifest

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 16
#: The longest the listener waits for a handshake, a request, or a slow reader.
IDLE_S = 30.0
BACKLOG = 64

Lookup = Callable[[MemberKey], Awaitable[MemberRecord | None]]


class OutputsListenFailed(Exception):
    """The outputs listener cannot be bound; ``str()`` names the setting and the fix."""


class Refusal(Exception):
    """A request the listener does not serve; ``str()`` is the sentence sent back."""


@attrs.define(eq=False)
class Bound:
    """A bound, listening socket and what the Node says about it in Hello."""

    sock: socket.socket
    identity: OutputsIdentity
    settings: OutputsSettings

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def listen_address(self) -> str:
        return join_host_port(str(self.sock.getsockname()[0]), self.port)

    def service(self, node_address: str) -> OutputsService:
        """What Hello says: ``advertise`` (else ``node_address``) and the bound port."""
        host = self.settings.advertise or node_address
        return OutputsService(
            join_host_port(host, self.port), self.identity.cert_sha256, self.identity.grant_key
        )


def bind(settings: OutputsSettings, identity: OutputsIdentity, path: Path | None) -> Bound:
    """Bind and listen on ``settings.listen``; :class:`OutputsListenFailed` naming the key."""
    host, port = settings.host_port()
    where = f"{path}: " if path else ""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise OutputsListenFailed(
            f'{where}[outputs] listen = "{settings.listen}" cannot be used '
            f'({exc.strerror or exc}); give an address of this host, or listen = "" to serve '
            "no outputs."
        ) from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise OutputsListenFailed(
            f'{where}[outputs] listen = "{settings.listen}" cannot be bound '
            f"({exc.strerror or exc}): another program may hold the port. Free it, pick "
            'another port, or set listen = "" to serve no outputs (this Node then cannot be '
            "the source of an --init-from on another Node)."
        ) from None
    return Bound(sock, identity, settings)


def server_context(identity: OutputsIdentity) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(identity.tls_path))
    return ctx


def now_ms() -> int:
    return int(time.time() * 1000)


@attrs.define(eq=False)
class OutputsServer:
    """Serves one bound socket until cancelled; ``lookup`` reads a member from the journal
    (None in safe mode: every request is refused)."""

    bound: Bound
    lookup: Lookup | None
    clock_ms: Callable[[], int] = now_ms
    _slots: trio.Semaphore = attrs.field(factory=lambda: trio.Semaphore(MAX_CONNECTIONS))

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        ctx = server_context(self.bound.identity)
        listener = trio.SSLListener(
            trio.SocketListener(trio.socket.from_stdlib_socket(self.bound.sock)), ctx
        )
        log.info("outputs listener serving address=%s cert_sha256=%s",
                 self.bound.listen_address(), self.bound.identity.cert_sha256)  # fmt: skip
        async with listener:
            task_status.started()
            await trio.serve_listeners(self._connection, [listener])

    async def _connection(self, stream: trio.SSLStream[trio.SocketStream]) -> None:
        peer = _peer(stream)
        try:
            self._slots.acquire_nowait()
        except trio.WouldBlock:
            log.warning("outputs refused peer=%s reason=more than %d connections at once",
                        peer, MAX_CONNECTIONS)  # fmt: skip
            await trio.aclose_forcefully(stream)
            return
        try:
            await self._converse(stream, peer)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError) as exc:
            log.info("outputs connection ended peer=%s reason=%s", peer,
                     type(exc).__name__)  # fmt: skip
        finally:
            self._slots.release()
            await trio.aclose_forcefully(stream)

    async def _converse(self, stream: trio.SSLStream[trio.SocketStream], peer: str) -> None:
        while True:
            try:
                payload = await _read_frame(stream)
                if payload is None:
                    return
                request = ow.decode_request(payload)
            except ow.FrameError as exc:
                log.warning("outputs refused peer=%s reason=%s", peer, exc)
                await _send(stream, ow.encode_response(ow.Response(False, error=str(exc))))
                return
            try:
                await self._answer(stream, request, peer)
            except Refusal as exc:
                log.warning("outputs refused run_id=%s member=%s what=%s peer=%s reason=%s",
                            request.run_id, request.member, request.path or request.op, peer,
                            exc)  # fmt: skip
                await _send(stream, ow.encode_response(ow.Response(False, error=str(exc))))
                return

    async def _member(self, request: ow.Request) -> MemberRecord:
        """The ended member the request names, once its grant is checked; else :class:`Refusal`."""
        what = f"member {request.member_index} of run {request.run_id} attempt {request.attempt}"
        now = self.clock_ms()
        if request.expires_at_ms <= now:
            raise Refusal(
                f"The grant for {what} expired at {request.expires_at_ms} (it is {now} here); "
                "the coordinator sends a fresh one with the next Prepare."
            )
        if not grant_valid(
            self.bound.identity.grant_key, request.grant, request.run_id, request.attempt,
            request.member_index, request.expires_at_ms, now,
        ):  # fmt: skip
            raise Refusal(
                f"The grant is not this Node's for {what}; only a grant the coordinator made "
                "for that member with this Node's grant key is served."
            )
        if self.lookup is None:
            raise Refusal(
                "This Node's journal failed its integrity check (safe mode), so it serves no "
                "outputs until an operator repairs it."
            )
        record = await self.lookup(MemberKey(request.run_id, request.attempt,
                                             request.member_index))  # fmt: skip
        if record is None or record.state is not MemberState.EXITED:
            state = "not known here" if record is None else record.state.value
            raise Refusal(
                f"This Node serves only the outputs of members that have exited, and {what} "
                f"is {state}."
            )
        if record.out_dir != request.out_dir:
            raise Refusal(f"The output directory of {what} on this Node is not {request.out_dir}.")
        return record

    async def _answer(
        self, stream: trio.SSLStream[trio.SocketStream], request: ow.Request, peer: str
    ) -> None:
        record = await self._member(request)
        run = f"run {request.run_id}"
        manifest_file = Path(manifest_path(record.out_dir))
        try:
            data = await trio.to_thread.run_sync(read_manifest_file, manifest_file)
        except (OSError, ManifestProblem) as exc:
            raise Refusal(
                f"The output manifest of {run} cannot be read on this Node: {exc}"
            ) from None
        if request.op == "manifest":
            await _send(stream, ow.encode_response(ow.Response(True, size=len(data))) + data)
            log.info("outputs served run_id=%s member=%s what=manifest bytes=%d peer=%s",
                     request.run_id, request.member, len(data), peer)  # fmt: skip
            return
        try:
            manifest = read_manifest(data, str(manifest_file))
        except ManifestProblem as exc:
            raise Refusal(str(exc)) from None
        if request.path not in {e.path for e in manifest.files}:
            raise Refusal(f"The output manifest of {run} lists no file {request.path!r}.")
        try:
            f = await trio.to_thread.run_sync(
                open_source_file, Path(record.out_dir), request.path, run
            )
        except SourceUnreadable as exc:
            raise Refusal(str(exc)) from None
        with f:
            size = os.fstat(f.fileno()).st_size
            await _send(stream, ow.encode_response(ow.Response(True, size=size)))
            sent = await _send_body(stream, f, size)
        log.info("outputs served run_id=%s member=%s what=%s bytes=%d peer=%s",
                 request.run_id, request.member, request.path, sent, peer)  # fmt: skip
        if sent != size:
            # The file shrank while it was sent: the body is short, so the frame is broken.
            raise trio.BrokenResourceError(f"{request.path} ended after {sent} of {size} bytes")


async def _send_body(stream: trio.SSLStream[trio.SocketStream], f: BinaryIO, size: int) -> int:
    sent = 0
    while sent < size:
        chunk = await trio.to_thread.run_sync(f.read, min(CHUNK_BYTES, size - sent))
        if not chunk:
            break
        await _send(stream, chunk)
        sent += len(chunk)
    return sent


async def _send(stream: trio.SSLStream[trio.SocketStream], data: bytes) -> None:
    with trio.fail_after(IDLE_S):
        await stream.send_all(data)


async def _receive_exact(stream: trio.SSLStream[trio.SocketStream], size: int) -> bytes:
    data = b""
    while len(data) < size:
        with trio.fail_after(IDLE_S):
            chunk = await stream.receive_some(size - len(data))
        if not chunk:
            raise trio.BrokenResourceError("the peer hung up inside a frame")
        data += bytes(chunk)
    return data


async def _read_frame(stream: trio.SSLStream[trio.SocketStream]) -> bytes | None:
    """The next request's body; None when the peer closed between requests."""
    with trio.fail_after(IDLE_S):
        first = await stream.receive_some(ow.PREFIX_BYTES)
    if not first:
        return None
    prefix = bytes(first) + await _receive_exact(stream, ow.PREFIX_BYTES - len(first))
    # A length over the bound is refused here, before a byte of the body is read.
    size = ow.body_length(prefix, ow.MAX_REQUEST_BYTES, "request")
    return await _receive_exact(stream, size)


def _peer(stream: trio.SSLStream[trio.SocketStream]) -> str:
    try:
        name = stream.transport_stream.socket.getpeername()
    except OSError:
        return "unknown"
    return join_host_port(str(name[0]), int(name[1]))
