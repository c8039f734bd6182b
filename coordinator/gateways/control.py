"""The node control gateway (``tuneplane.v1.Control``): Enroll and the Connect stream.

Rules:
- Enroll spends a single-use, unexpired join token and hands out a fresh Node id and a random
  control credential (stored hashed). Connect is authenticated by that credential only.
- On Connect the first message must be Hello; the coordinator answers Welcome and then acks every
  Heartbeat and every MemberReport. A Heartbeat is acked from memory
  (:mod:`~tuneplane.coordinator.gateways.heartbeats` stores the times in batches); only an inventory
  change it carries is written before the ack.
- A report is applied only as a move its member's lifecycle allows on this Node
  (:func:`~tuneplane.coordinator.lifecycle.judge_report`); a refused one is acked with the
  sentence in ``ReportAck.refused`` and changes nothing. A second Connect of one Node ends the
  first, and the takeover is recorded (see :mod:`~tuneplane.coordinator.gateways.sessions`).
- Dead peers are found by silence, not TCP: nothing heard for ``heartbeat_timeout`` closes the
  stream. Whatever ends a stream, the Node is recorded ``disconnected`` and its members
  ``unknown`` (never failed) - unless a newer stream of the same Node already replaced it.
- A Node that comes back after it was declared lost (:mod:`~tuneplane.coordinator.node_loss`)
  gets, after Welcome, a Cancel marked ``declared_lost`` for each such member its Hello still
  holds (and for each it asks about with DecisionQuery); its reports about them are refused.
- Control credentials expire and rotate (:mod:`~tuneplane.coordinator.store.identity`): Welcome
  says when the stream's credential expires; a CredentialRenewal gets a successor that works
  beside the old one until the Node says CredentialStored or connects with it. A revoked or
  expired credential is refused before Hello is read.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Callable
from typing import Any

import anyio
import betterproto
from grpclib import GRPCError
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import StreamTerminatedError

from tuneplane.agent.crashpoint import crashpoint
from tuneplane.proto import v1

from ..auth import (
    DEFAULT_NODE_CREDENTIAL_LIFETIME_S,
    NODE_PREFIX,
    AuthError,
    CredentialLife,
    PermissionDenied,
    bearer_token,
    check_node_credential,
    hash_credential,
    new_credential,
)
from ..clock import now_ms
from ..server.control_address import ControlAddressDesk
from ..store import identity as store_identity
from ..store.core import Store
from ..store.lifecycle import (
    declared_lost_order,
    declared_lost_stops,
    stop_siblings,
    stops_to_resend,
)
from ..store.logs import LogStore
from ..values.fleet import NodeRecord
from ..values.orders import AbortOrder, CommitOrder, Order
from ..wire.control import (
    held_from_wire,
    inventory_from_wire,
    outputs_from_wire,
    report_from_wire,
)
from ..wire.members import member_key
from ..wire.status import grpc_errors
from . import outputs_grants
from .collector_credentials import (
    CollectorCredentials,
    is_collector_credential,
)
from .heartbeats import HeartbeatBook
from .logship import receive_chunk
from .message_limits import encoded_off_loop
from .rate_limit import PeerRateLimit, peer_host
from .sessions import NodeSession, SessionRegistry

log = logging.getLogger(__name__)


def _peer(stream: Any) -> str:
    """The client's ``HOST:PORT`` as the listener saw it ("" when the transport does not say)."""
    try:
        addr = stream.peer.addr()
    except AttributeError:
        return ""
    return f"{addr[0]}:{addr[1]}" if addr else ""


class ControlGateway:
    """grpclib handlers for ``tuneplane.v1.Control``."""

    def __init__(
        self,
        store: Store,
        registry: SessionRegistry,
        wake_scheduler: Callable[[], None],
        heartbeat_interval_s: float,
        heartbeat_timeout_s: float,
        collectors: CollectorCredentials | None = None,
        logs: LogStore | None = None,
        *,
        heartbeats: HeartbeatBook,
        credential_lifetime_s: int = DEFAULT_NODE_CREDENTIAL_LIFETIME_S,
        enroll_limit: PeerRateLimit | None = None,
        addresses: ControlAddressDesk | None = None,
    ) -> None:
        # The control address every Welcome names (tuneplane-coordinator control-address).
        self._addresses = addresses
        # Enroll is the one call anyone may make: each address gets a token bucket.
        self._enroll_limit = enroll_limit if enroll_limit is not None else PeerRateLimit(0, 0)
        self._credential_lifetime_ms = credential_lifetime_s * 1000
        # node id -> (request id, hash) of the successor credential handed out on its stream.
        self._issued: dict[str, tuple[int, str]] = {}
        # node id -> when the credential its live stream uses expires (epoch ms): a stream does
        # not outlive its credential, even if the Node never renews.
        self._expires: dict[str, int] = {}
        self._logs = logs
        self._heartbeats = heartbeats
        self._store = store
        self._registry = registry
        self._wake = wake_scheduler
        self._interval = heartbeat_interval_s
        self._timeout = heartbeat_timeout_s
        self._collectors = collectors

    def __mapping__(self) -> dict[str, Handler]:
        return {
            "/tuneplane.v1.Control/Enroll": Handler(
                self._enroll, Cardinality.UNARY_UNARY, v1.EnrollRequest, v1.EnrollReply
            ),
            "/tuneplane.v1.Control/Connect": Handler(
                self._connect, Cardinality.STREAM_STREAM, v1.NodeMessage, v1.CoordinatorMessage
            ),
        }

    def _refuse_enroll_flood(self, stream: Any) -> None:
        """RESOURCE_EXHAUSTED, before the request is read, for an address over its Enroll rate."""
        peer = peer_host(stream.peer.addr() if stream.peer is not None else None)
        wait = self._enroll_limit.take(peer, time.monotonic())
        if wait > 0:
            log.warning("enroll refused: rate limit peer=%s retry_after_s=%.1f", peer, wait)
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED,
                f"Too many Enroll calls from {peer}; retry in {math.ceil(wait)} s (the "
                "coordinator's [limits] enroll_burst and enroll_per_second).",
            )

    async def _enroll(self, stream: Any) -> None:
        with grpc_errors():
            self._refuse_enroll_flood(stream)
            request: v1.EnrollRequest = await stream.recv_message()
            if not request.join_token:
                raise AuthError(
                    "EnrollRequest.join_token is empty. Pass the join token from "
                    "`tuneplane-coordinator token create` to `tuneplane-node enroll`."
                )
            credential = new_credential(NODE_PREFIX)
            inventory = inventory_from_wire(request.inventory, request.hostname)
            now = now_ms()
            expires = now + self._credential_lifetime_ms
            if request.node_id:
                # Re-enrolment: the same Node (its id, proven by a join token of its Fleet that
                # the operator issued for it) gets a new credential and keeps its members.
                node_id = request.node_id
                fleet = await store_identity.reenroll(
                    self._store,
                    hash_credential(request.join_token),
                    node_id,
                    inventory,
                    hash_credential(credential),
                    expires,
                    now,
                )
                self._issued.pop(node_id, None)
                self._registry.end(node_id, "the Node was re-enrolled; its old credential is void")
            else:
                node_id = "node-" + secrets.token_hex(8)
                fleet = await self._store.enroll(
                    hash_credential(request.join_token),
                    node_id,
                    inventory,
                    hash_credential(credential),
                    now,
                    expires,
                )
            log.info(
                "node enrolled node=%s fleet=%s hostname=%s again=%s",
                node_id,
                fleet,
                inventory.hostname,
                bool(request.node_id),
            )
            await stream.send_message(
                v1.EnrollReply(
                    node_id=node_id,
                    fleet=fleet,
                    node_credential=credential,
                    credential_issued_at_ms=now,
                    credential_expires_at_ms=expires,
                )
            )

    async def _with_credentials(self, orders: list[Order]) -> list[Order]:
        """Commit orders carry a fresh collector credential, recorded before they are sent;
        Prepare orders whose source is on another Node carry a fresh fetch grant."""
        orders = await outputs_grants.attach(self._store, orders, now_ms())
        if self._collectors is None:
            return orders
        return await self._collectors.attach(orders, now_ms())

    async def _authenticate(self, stream: Any) -> tuple[NodeRecord, CredentialLife]:
        token = bearer_token(stream.metadata.items() if stream.metadata else ())
        if is_collector_credential(token):
            raise PermissionDenied(
                "a collector credential opens only the telemetry gateway, never the control "
                "gateway. Connect with the Node's control credential (credentials/control.token)."
            )
        credential_hash = hash_credential(token)
        match = await store_identity.node_for_credential(self._store, credential_hash)
        if match is None:
            raise AuthError(
                "this Node is not enrolled with this coordinator (its control credential is "
                "unknown: never issued, or retired by a rotation or a re-enrolment). Re-enroll "
                "it with `tuneplane-node enroll --re-enroll` and a join token made for it "
                "(`tuneplane-coordinator token create --node <node id>`)."
            )
        now = now_ms()
        check_node_credential(match.node.id, match.life, now)
        life = match.life
        if match.is_next:
            # Connecting with the successor proves the Node stored it: the old one retires.
            confirmed = await store_identity.confirm_rotation(
                self._store, match.node.id, credential_hash, now, "Connect"
            )
            life = confirmed or life
            log.info("node credential rotated node=%s via=Connect", match.node.id)
        if life.expires_at_ms is None:
            # Issued before credentials expired: its lifetime starts now, and the Node renews it.
            life = CredentialLife(now, now + self._credential_lifetime_ms)
            await store_identity.start_lifetime(
                self._store, match.node.id, now, life.expires_at_ms or 0
            )
        return match.node, life

    async def _hello(self, stream: Any, node: NodeRecord) -> v1.Hello:
        with anyio.move_on_after(self._timeout):
            first: v1.NodeMessage | None = await stream.recv_message()
            if first is None:
                raise GRPCError(
                    Status.INVALID_ARGUMENT, "the Connect stream ended before its Hello."
                )
            kind, body = betterproto.which_one_of(first, "body")
            if kind != "hello":
                raise GRPCError(
                    Status.FAILED_PRECONDITION,
                    f"the first message on Connect must be Hello, not {kind or 'an empty message'}."
                    " Upgrade the Node.",
                )
            assert isinstance(body, v1.Hello)
            if body.node_id and body.node_id != node.id:
                raise PermissionDenied(
                    f"Hello names Node {body.node_id!r}, but the credential belongs to Node "
                    f"{node.id!r}. Check the Node's state directory (node.json)."
                )
            return body
        raise GRPCError(
            Status.DEADLINE_EXCEEDED,
            f"no Hello within {self._timeout:g} s of opening Connect. Send Hello first.",
        )

    async def _connect(self, stream: Any) -> None:
        with grpc_errors():
            node, life = await self._authenticate(stream)
            hello = await self._hello(stream, node)
            session = NodeSession.create(node.id, _peer(stream), now_ms())
            replaced = self._registry.attach(session)
            if replaced is not None:
                await self._store.session_replaced(
                    node.id, replaced.peer, session.peer, replaced.opened_at_ms, now_ms()
                )
            log.info("control stream opened node=%s agent=%s", node.id, hello.agent_version)
            if life.expires_at_ms is not None:
                self._expires[node.id] = life.expires_at_ms
            try:
                with session.scope:
                    await self._run_session(stream, session, node, hello, life)
            finally:
                with anyio.CancelScope(shield=True):
                    if self._registry.detach(session):
                        self._expires.pop(node.id, None)
                        await self._store.node_disconnected(
                            node.id, now_ms(), session.close_reason or "the stream ended"
                        )
                    session.finished.set()
                log.info(
                    "control stream closed node=%s why=%s",
                    node.id,
                    session.close_reason or "the stream ended",
                )
            if session.close_reason:
                raise GRPCError(Status.UNAVAILABLE, session.close_reason)

    async def _run_session(
        self,
        stream: Any,
        session: NodeSession,
        node: NodeRecord,
        hello: v1.Hello,
        life: CredentialLife,
    ) -> None:
        connected_at = now_ms()
        held = held_from_wire(hello)
        orders = await self._store.node_connected(
            node.id,
            inventory_from_wire(hello.inventory, node.hostname),
            held,
            connected_at,
            hello.dialed_address,
            outputs_grants.accepted_service(node.id, outputs_from_wire(hello)),
        )
        self._heartbeats.record(node.id, connected_at)
        # Stops decided while the Node was away go now (members declared lost among them); a
        # member being stopped gets no Commit.
        stops = await stops_to_resend(self._store, node.id)
        stops += await declared_lost_stops(self._store, node.id, held)
        stopping = {s.member for s in stops}
        orders = [
            o for o in orders if not (isinstance(o, CommitOrder) and o.member in stopping)
        ] + list(stops)
        await stream.send_message(
            v1.CoordinatorMessage(
                welcome=v1.Welcome(
                    heartbeat_interval_ms=int(self._interval * 1000),
                    heartbeat_timeout_ms=int(self._timeout * 1000),
                    server_time_ms=now_ms(),
                    credential_issued_at_ms=life.issued_at_ms or 0,
                    credential_expires_at_ms=life.expires_at_ms or 0,
                    control_address=self._addresses.address if self._addresses else "",
                )
            )
        )
        self._registry.dispatch(await self._with_credentials(orders))
        self._wake()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._pump, stream, session)
            why = await self._read(stream, session)
            if why:
                session.close_reason = why
            tg.cancel_scope.cancel()

    async def _pump(self, stream: Any, session: NodeSession) -> None:
        async for message in session.inbox:
            # A Prepare carries the whole JobSpec (megabytes with experiment files).
            big = betterproto.which_one_of(message, "body")[0] == "prepare"
            size = len(message.prepare.jobspec_json) if big else 0
            await stream.send_message(await encoded_off_loop(message, size))

    async def _read(self, stream: Any, session: NodeSession) -> str:
        """Handle messages until the stream ends; returns why it should close ("" if cleanly)."""
        while True:
            try:
                with anyio.move_on_after(self._timeout) as waited:
                    message: v1.NodeMessage | None = await stream.recv_message()
            except StreamTerminatedError:
                return "the Node reset the stream"
            if waited.cancelled_caught:
                log.warning(
                    "node silent; closing its control stream node=%s timeout_s=%g",
                    session.node_id,
                    self._timeout,
                )
                return (
                    f"the coordinator heard nothing from this Node for {self._timeout:g} s "
                    "(heartbeat timeout); reconnect"
                )
            if message is None:
                return ""
            await self._handle(session, message)

    async def _handle(self, session: NodeSession, message: v1.NodeMessage) -> None:
        node_id = session.node_id
        kind, body = betterproto.which_one_of(message, "body")
        now = now_ms()
        if isinstance(body, v1.Heartbeat):
            if now >= self._expires.get(node_id, now + 1):
                session.close(
                    "this stream's control credential expired; the Node must renew before "
                    "expiry or be re-enrolled with a new join token"
                )
                return
            if betterproto.serialized_on_wire(body.inventory):
                # An inventory change is what placement reads: stored before the ack.
                await self._store.node_inventory(node_id, inventory_from_wire(body.inventory), now)
                self._wake()
            # The time itself waits in memory for the next batch (and renews collector
            # credentials there): no store round trip delays the ack.
            self._heartbeats.record(node_id, now)
            self._registry.send(
                node_id, v1.CoordinatorMessage(heartbeat_ack=v1.HeartbeatAck(seq=body.seq))
            )
        elif isinstance(body, v1.MemberReport):
            report = report_from_wire(body)
            outcome = await self._store.apply_report(node_id, report, now)
            if outcome.early:
                # It overtook a report before it: unacknowledged, the Node sends it again.
                log.info(
                    "member report early node=%s journal=%s seq=%d run_id=%s member=%d state=%s",
                    node_id, report.journal_id or "-", report.report_seq, report.member.run_id,
                    report.member.member_index, report.state,
                )  # fmt: skip
                return
            if outcome.refused:
                log.warning(
                    "member report refused node=%s journal=%s seq=%d run_id=%s attempt=%d "
                    "member=%d state=%s reason=%s",
                    node_id, report.journal_id or "-", report.report_seq, report.member.run_id,
                    report.member.attempt, report.member.member_index, report.state,
                    outcome.refused,
                )  # fmt: skip
            else:
                log.info(
                    "member report node=%s journal=%s seq=%d run_id=%s member=%d state=%s "
                    "applied=%s",
                    node_id, report.journal_id or "-", report.report_seq, report.member.run_id,
                    report.member.member_index, report.state, outcome.applied,
                )  # fmt: skip
            if outcome.applied:
                crashpoint("after-report-applied")
            if self._collectors is not None and outcome.ended:
                # Also for a repeated report: the store may have applied it before a crash.
                await self._collectors.member_ended(report.member, now)
            self._registry.send(
                node_id,
                v1.CoordinatorMessage(
                    report_ack=v1.ReportAck(report_seq=body.report_seq, refused=outcome.refused)
                ),
            )
            if outcome.applied:
                self._wake()
            if outcome.ended:
                # Also for a repeat: the first copy may have been applied just before a crash.
                self._registry.dispatch(await stop_siblings(self._store, report.member, now))
        elif isinstance(body, v1.LogChunk):
            if self._logs is not None:
                ack = await receive_chunk(self._store, self._logs, node_id, body, now)
                self._registry.send(node_id, v1.CoordinatorMessage(log_ack=ack))
        elif isinstance(body, v1.PrepareReply):
            rendezvous = body.rendezvous or v1.Rendezvous()
            orders = await self._store.record_prepare_reply(
                node_id,
                member_key(body.member),
                body.ok,
                body.reason,
                rendezvous.master_addr,
                rendezvous.master_port,
                now,
                rendezvous_held=body.rendezvous_held,
            )
            if any(isinstance(o, CommitOrder) for o in orders):
                crashpoint("after-commit-decided")
            if any(isinstance(o, AbortOrder) for o in orders):
                crashpoint("after-abort-decided")
            self._registry.dispatch(await self._with_credentials(orders))
            if any(isinstance(o, AbortOrder) for o in orders):
                self._wake()
        elif isinstance(body, v1.DecisionQuery):
            # A member declared lost gets its stop, never the Commit its attempt recorded.
            key = member_key(body.member)
            order: Order | None = await declared_lost_order(self._store, node_id, key)
            if order is None:
                order = await self._store.decision_for(node_id, key)
            if order is not None:
                self._registry.dispatch(await self._with_credentials([order]))
        elif isinstance(body, v1.CredentialRenewal):
            await self._renew(node_id, body.request_id, now)
        elif isinstance(body, v1.CredentialStored):
            issued = self._issued.get(node_id)
            if issued is not None and issued[0] == body.request_id:
                del self._issued[node_id]
                confirmed = await store_identity.confirm_rotation(
                    self._store, node_id, issued[1], now, "CredentialStored"
                )
                if confirmed is not None and confirmed.expires_at_ms is not None:
                    self._expires[node_id] = confirmed.expires_at_ms
                log.info(
                    "node credential rotated node=%s via=CredentialStored applied=%s",
                    node_id,
                    confirmed is not None,
                )
        else:
            log.warning("unexpected message on control stream node=%s kind=%s", node_id, kind)

    async def _renew(self, node_id: str, request_id: int, now: int) -> None:
        """Hand out a successor credential; the old one keeps working until it is confirmed."""
        credential = new_credential(NODE_PREFIX)
        expires = now + self._credential_lifetime_ms
        credential_hash = hash_credential(credential)
        # Recorded before it is sent: a Node that stores it and then crashes can use it.
        if not await store_identity.issue_next_credential(
            self._store, node_id, credential_hash, now, expires
        ):
            return
        self._issued[node_id] = (request_id, credential_hash)
        log.info("node credential issued node=%s request_id=%d", node_id, request_id)
        self._registry.send(
            node_id,
            v1.CoordinatorMessage(
                credential_issued=v1.CredentialIssued(
                    request_id=request_id,
                    node_credential=credential,
                    credential_issued_at_ms=now,
                    credential_expires_at_ms=expires,
                )
            ),
        )
