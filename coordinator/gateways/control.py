"""The node control gateway (``tuneplane.v1.Control``): the Connect stream, Hello to its end.

Rules:
- Connect is authenticated by the Node's control credential only
  (:mod:`~tuneplane.coordinator.gateways.node_credentials`); Enroll is
  :mod:`~tuneplane.coordinator.gateways.enroll`'s.
- On Connect the first message must be Hello; the coordinator answers Welcome (saying when the
  stream's credential expires) and then handles every message
  (:mod:`~tuneplane.coordinator.gateways.node_messages`). A second Connect of one Node ends the
  first, and the takeover is recorded (see :mod:`~tuneplane.coordinator.gateways.sessions`).
- Dead peers are found by silence, not TCP: nothing heard for ``heartbeat_timeout`` closes the
  stream (:mod:`~tuneplane.coordinator.gateways.silence`). Whatever ends a stream, the Node is
  recorded ``disconnected`` and its members ``unknown`` (never failed) - unless a newer stream
  of the same Node already replaced it.
- Hello says the agent's release, control protocol and capabilities; an agent outside the
  version-skew policy (:func:`~tuneplane.proto.contract.control_protocol.judge_agent`) is refused
  with FAILED_PRECONDITION and a sentence naming both versions before anything of the Node is
  recorded. Welcome says this coordinator's; the session's capabilities decide what the Node is
  sent (:class:`~tuneplane.coordinator.gateways.sessions.NodeSession`).
- A Node that comes back after it was declared lost (:mod:`~tuneplane.coordinator.node_loss`)
  gets, after Welcome, a Cancel marked ``declared_lost`` for each such member its Hello still
  holds; its reports about them are refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import anyio
import betterproto
from grpclib import GRPCError
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import StreamTerminatedError

from tuneplane.proto import v1
from tuneplane.proto.contract import control_protocol as protocol

from ..auth import DEFAULT_NODE_CREDENTIAL_LIFETIME_S, CredentialLife, PermissionDenied
from ..clock import now_ms
from ..counters import CONNECTS_DEFERRED, CONNECTS_QUEUED
from ..hello_gate import GateSettings, HelloGate, Ticket
from ..preparations import PreparationBook
from ..store.core import Store
from ..store.hellos import NodeHello, ReplacedStream
from ..store.lifecycle import stops_to_resend
from ..store.logs import LogStore
from ..store.lost_nodes import declared_lost_stops
from ..values.fleet import NodeRecord
from ..values.orders import CancelOrder, CommitOrder
from ..wire.control import held_from_wire, inventory_from_wire, outputs_from_wire
from . import outputs_grants
from .collector_credentials import CollectorCredentials
from .control_address import ControlAddressDesk
from .enroll import EnrollHandler
from .heartbeat_layout import plain_heartbeat
from .heartbeats import HeartbeatBook
from .message_limits import decoded, encoded, send_encoded
from .node_credentials import NodeCredentials
from .node_messages import NodeMessages
from .rate_limit import PeerRateLimit
from .sessions import NodeSession, SessionRegistry
from .silence import SilenceWatch
from .status import grpc_errors

log = logging.getLogger(__name__)

#: This coordinator's release, said in every Welcome and in every refusal.
RELEASE = protocol.release()
#: How long a busy refusal's stream is held for its Node to read the refusal and reset it.
REFUSAL_READ_S = 2.0


def _judge(node_id: str, agent: protocol.Peer) -> None:
    """Refuse (FAILED_PRECONDITION, a sentence naming both versions) an agent outside the
    version-skew policy; nothing of the Node has been recorded yet."""
    refusal = protocol.judge_agent(agent, RELEASE)
    if refusal is not None:
        log.warning("node refused: outside the version-skew policy node=%s agent=%s protocol=%d",
                    node_id, agent.version, agent.protocol)  # fmt: skip
        raise GRPCError(Status.FAILED_PRECONDITION, refusal)


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
        gate: GateSettings | None = None,
        preparations: PreparationBook | None = None,
    ) -> None:
        # The control address every Welcome names (tuneplane-coordinator control-address).
        self._addresses = addresses
        self._credentials = NodeCredentials(store, registry, credential_lifetime_s)
        # Enroll is the one call anyone may make: each address gets a token bucket.
        self._enroll = EnrollHandler(
            store,
            registry,
            self._credentials,
            enroll_limit if enroll_limit is not None else PeerRateLimit(0, 0),
        )
        self._messages = NodeMessages(
            store, registry, wake_scheduler, heartbeats, self._credentials, collectors, logs,
            preparations,
        )  # fmt: skip
        self._heartbeats = heartbeats
        self._store = store
        self._registry = registry
        self._wake = wake_scheduler
        self._interval = heartbeat_interval_s
        self._timeout = heartbeat_timeout_s
        # Connects taken on at once in a reconnect storm (coordinator/hello_gate.py).
        self._gate = HelloGate(gate or GateSettings())
        self._turns = anyio.Semaphore(self._gate.settings.concurrency)
        self._deferred_logged_at = 0.0
        self._deferred_logged = 0

    def __mapping__(self) -> dict[str, Handler]:
        return {
            "/tuneplane.v1.Control/Enroll": Handler(
                self._enroll.enroll, Cardinality.UNARY_UNARY, v1.EnrollRequest, v1.EnrollReply
            ),
            "/tuneplane.v1.Control/Connect": Handler(
                self._connect, Cardinality.STREAM_STREAM, v1.NodeMessage, v1.CoordinatorMessage
            ),
        }

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
            gate = self._gate
            said = protocol.from_metadata(dict(stream.metadata or {}))
            patient = said is not None and said.can(protocol.Capability.QUEUED_CONNECT)
            known: tuple[NodeRecord, CredentialLife] | None = None
            if patient and gate.settings.max_queue_s > 0:
                # A Connect that may wait long is authenticated (and judged) first, so the line
                # holds only Nodes, and a refusal still comes before any initial metadata.
                known = await self._credentials.authenticate(stream)
                assert said is not None
                _judge(known[0].id, said)
            else:
                patient = False
            expected_s = gate.expected_wait()
            if not gate.arrive(anyio.current_time(), patient):
                await self._refuse_busy(stream)
                return
            queued = False
            try:
                if patient and (expected_s or self._turns.value == 0):
                    await self._queued(stream, expected_s)
                    queued = True
                with anyio.move_on_after(gate.longest_wait(patient)) as waited:
                    await self._turns.acquire()
            except BaseException:
                gate.left(anyio.current_time())
                raise
            if waited.cancelled_caught:
                gate.gave_up(anyio.current_time())
                if queued:
                    # Its initial metadata is gone: the Node hears a reset and dials again.
                    raise GRPCError(Status.UNAVAILABLE, gate.busy_sentence(None))
                await self._refuse_busy(stream)
                return
            started = anyio.current_time()
            gate.start(started)
            ticket = Ticket(gate, anyio.current_time, self._turns.release, started)
            try:
                await self._taken_on(stream, ticket, said, known)
            finally:
                ticket.release()

    async def _queued(self, stream: Any, expected_s: float | None) -> None:
        """Tell a Connect that can wait in line its place: the sentence and the wait expected
        (the longest it may wait, before any Welcome was measured)."""
        CONNECTS_QUEUED.inc()
        gate = self._gate
        wait_s = gate.longest_wait(True) if expected_s is None else expected_s
        await stream.send_initial_metadata(
            metadata={
                protocol.QUEUED_HEADER: gate.queued_sentence(wait_s),
                protocol.WAIT_HEADER: str(round(wait_s * 1000)),
            }
        )

    async def _refuse_busy(self, stream: Any) -> None:
        """Refuse a Connect as busy: the sentence and the Node's turn in initial metadata
        (:data:`~tuneplane.proto.contract.control_protocol.BUSY_HEADER`), held until the Node
        resets the stream, then UNAVAILABLE for one that did not read them. Counted, and said in
        the log at most once a second."""
        CONNECTS_DEFERRED.inc()
        gate = self._gate
        now = anyio.current_time()
        come_back_s = gate.come_back_in(now)
        if now - self._deferred_logged_at >= 1.0:
            log.warning("connects deferred: busy welcoming in_flight=%d waiting=%d "
                        "rate_per_s=%.0f deferred=%d come_back_s=%s", gate.in_flight,
                        gate.waiting, gate.rate, gate.deferred - self._deferred_logged,
                        "" if come_back_s is None else f"{come_back_s:.1f}")  # fmt: skip
            self._deferred_logged_at = now
            self._deferred_logged = gate.deferred
        sentence = gate.busy_sentence(come_back_s)
        said = {protocol.BUSY_HEADER: sentence}
        if come_back_s is not None:
            said[protocol.COME_BACK_HEADER] = str(round(come_back_s * 1000))
        await stream.send_initial_metadata(metadata=said)
        # A Node that read them resets the stream, which cancels this handler. Nothing it sent
        # is read: decoding and checking the Hellos of refused Connects was most of the
        # coordinator's work in a 5,000-Node storm (py-spy).
        await anyio.sleep(REFUSAL_READ_S)
        await stream.send_trailing_metadata(status=Status.UNAVAILABLE, status_message=sentence)

    async def _taken_on(
        self,
        stream: Any,
        ticket: Ticket,
        said: protocol.Peer | None,
        known: tuple[NodeRecord, CredentialLife] | None,
    ) -> None:
        """The Connect, Hello to its end, once the gate took it on (``said``: the agent as its
        request metadata says it; ``known``: the Node and credential it was authenticated as
        before it waited in line)."""
        if known is None:
            node, life = await self._credentials.authenticate(stream)
            if said is not None:
                # Before any Hello: the agent's probe for why it was refused ends here too.
                _judge(node.id, said)
        else:
            node, life = known
        hello = await self._hello(stream, node)
        agent = protocol.Peer.said(hello.agent_version, hello.protocol, hello.capabilities)
        _judge(node.id, agent)
        session = NodeSession.create(node.id, _peer(stream), now_ms(), agent.capabilities)
        old = self._registry.attach(session)
        # Audited in the Hello's own transaction (the newer stream wins).
        replaced = (
            None
            if old is None
            else ReplacedStream(old.peer, session.peer, old.opened_at_ms, now_ms())
        )
        log.info("control stream opened node=%s agent=%s protocol=%d", node.id, agent.version,
                 agent.protocol)  # fmt: skip
        self._credentials.opened(node.id, life)
        try:
            with session.scope:
                await self._run_session(stream, session, node, hello, life, replaced, ticket)
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    if self._registry.detach(session):
                        self._credentials.closed(node.id)
                        await self._store.node_disconnected(
                            node.id, now_ms(), session.close_reason or "the stream ended"
                        )
                finally:
                    # Even when recording it failed (the store fenced a coordinator that
                    # lost its lease): whoever waits for this session must not wait forever.
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
        replaced: ReplacedStream | None,
        ticket: Ticket,
    ) -> None:
        connected_at = now_ms()
        held = held_from_wire(hello)
        welcomed = await self._store.hello(
            NodeHello(
                node.id,
                inventory_from_wire(hello.inventory, node.hostname),
                tuple(held),
                connected_at,
                hello.dialed_address,
                outputs_grants.accepted_service(node.id, outputs_from_wire(hello)),
                replaced,
            )
        )
        self._heartbeats.record(node.id, connected_at)
        # Stops decided while the Node was away go now (members declared lost among them); a
        # member being stopped gets no Commit. A Node with no member row has none to stop: in a
        # reconnect storm most Nodes skip these two reads.
        stops: list[CancelOrder] = []
        if welcomed.holds_members:
            stops = await stops_to_resend(self._store, node.id)
            stops += await declared_lost_stops(self._store, node.id, held)
        stopping = {s.member for s in stops}
        orders = [
            o for o in welcomed.orders if not (isinstance(o, CommitOrder) and o.member in stopping)
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
                    coordinators=list(self._addresses.coordinators) if self._addresses else [],
                    coordinator_version=RELEASE,
                    protocol=protocol.PROTOCOL,
                    capabilities=list(protocol.COORDINATOR_CAPABILITIES),
                )
            )
        )
        ticket.welcomed()
        self._registry.dispatch(await self._messages.with_credentials(orders))
        self._wake()
        silence = SilenceWatch(self._timeout)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._pump, stream, session)
            tg.start_soon(self._close_when_silent, session, silence)
            why = await self._read(stream, session, silence)
            if why:
                session.close_reason = why
            tg.cancel_scope.cancel()

    async def _close_when_silent(self, session: NodeSession, silence: SilenceWatch) -> None:
        await silence.until_silent()
        log.warning("node silent; closing its control stream node=%s timeout_s=%g",
                    session.node_id, self._timeout)  # fmt: skip
        session.close(
            f"the coordinator heard nothing from this Node for {self._timeout:g} s "
            "(heartbeat timeout); reconnect"
        )

    async def _pump(self, stream: Any, session: NodeSession) -> None:
        while True:
            item = await session.outbox.get()
            if not isinstance(item, bytes):
                # A Prepare carries the whole JobSpec (megabytes with experiment files).
                big = betterproto.which_one_of(item, "body")[0] == "prepare"
                item = await encoded(item, len(item.prepare.jobspec_json) if big else 0)
            await send_encoded(stream, item)

    async def _read(self, stream: Any, session: NodeSession, silence: SilenceWatch) -> str:
        """Handle messages until the stream ends; returns why it should close ("" if cleanly)."""
        while True:
            silence.waiting()
            try:
                data: bytes | None = await stream.recv_encoded()
            except StreamTerminatedError:
                return "the Node reset the stream"
            silence.heard()
            if data is None:
                return ""
            seq = plain_heartbeat(data)
            if seq is None:
                await self._messages.handle(session, await decoded(data, v1.NodeMessage))
            else:
                self._messages.heartbeat(session, seq, now_ms())
