"""The live control streams, one per connected Node, and how orders reach them.

Rules:
- At most one session per Node: attaching a second one closes the first (the newer Connect wins).
  Why not refuse the newer one: an agent whose TCP connection died silently reconnects long
  before the old stream's heartbeat timeout, and refusing it would lock an honest Node out for
  that long. A thief holding a stolen credential can push the real Node off, but the real Node
  reconnects and pushes back, and the gateway records every takeover in ``decisions`` and the
  log, so a fight over one Node's session is loud (and revoking the credential ends it).
- Sending never blocks the sender: each session has a bounded outbox; a full outbox means the
  Node is not reading, so its session is closed and the Node reconnects.
- On shutdown :meth:`SessionRegistry.close_all` closes every session and waits until each one has
  recorded its Node as disconnected.
"""

from __future__ import annotations

import logging
from collections import deque

import anyio
import attrs

from tuneplane.proto import v1

from ..values.orders import Order
from ..wire.control import order_to_wire

log = logging.getLogger(__name__)

OUTBOX_SIZE = 1024

#: What an outbox holds: a message, or one already encoded (a HeartbeatAck, see
#: :mod:`~tuneplane.coordinator.gateways.heartbeat_layout`).
Outgoing = v1.CoordinatorMessage | bytes


@attrs.define(eq=False)
class Outbox:
    """A session's queue of what goes to its Node, in order: putting never waits.

    A plain deque and one wake-up when the queue was empty: at 10,000 Nodes an ack goes out per
    heartbeat, and an anyio memory stream spent about 80 us of each on its waiter bookkeeping.
    """

    limit: int = OUTBOX_SIZE
    _queued: deque[Outgoing] = attrs.field(factory=deque, alias="queued")
    _waiting: anyio.Event | None = attrs.field(default=None, alias="waiting")

    def put(self, item: Outgoing) -> bool:
        """Queue ``item``; False (nothing queued) when :attr:`limit` items wait already."""
        if len(self._queued) >= self.limit:
            return False
        self._queued.append(item)
        if self._waiting is not None:
            self._waiting.set()
            self._waiting = None
        return True

    async def get(self) -> Outgoing:
        """The oldest queued item, once there is one."""
        while not self._queued:
            if self._waiting is None:
                self._waiting = anyio.Event()
            await self._waiting.wait()
        return self._queued.popleft()

    def __len__(self) -> int:
        return len(self._queued)


@attrs.define(eq=False)
class NodeSession:
    """One Node's control stream: its outbox and the cancel scope that closes it."""

    node_id: str
    outbox: Outbox = attrs.field(factory=Outbox)
    scope: anyio.CancelScope = attrs.field(factory=anyio.CancelScope)
    finished: anyio.Event = attrs.field(factory=anyio.Event)
    close_reason: str = ""
    peer: str = ""  # the client's HOST:PORT as the listener saw it, for the audit of takeovers
    opened_at_ms: int = 0
    # What the agent's Hello announced it takes (proto/contract/control_protocol.py): nothing
    # else is sent to it.
    capabilities: frozenset[str] = frozenset()

    @classmethod
    def create(
        cls,
        node_id: str,
        peer: str = "",
        opened_at_ms: int = 0,
        capabilities: frozenset[str] = frozenset(),
    ) -> NodeSession:
        return cls(node_id=node_id, peer=peer, opened_at_ms=opened_at_ms, capabilities=capabilities)

    def send(self, item: Outgoing) -> bool:
        """Queue ``item`` for this stream; a full outbox means the Node stopped reading, so the
        session is closed (the Node reconnects) and False is returned."""
        if self.close_reason:
            return False
        if not self.outbox.put(item):
            log.warning("control stream outbox full node=%s", self.node_id)
            self.close("the Node stopped reading its control stream")
            return False
        return True

    def close(self, reason: str) -> None:
        if not self.close_reason:
            self.close_reason = reason
        self.scope.cancel()


@attrs.define(eq=False)
class SessionRegistry:
    _sessions: dict[str, NodeSession] = attrs.field(factory=dict, alias="sessions")
    _closing: bool = attrs.field(default=False, alias="closing")

    def attach(self, session: NodeSession) -> NodeSession | None:
        """Make ``session`` the Node's session, closing an older one; returns the one closed."""
        if self._closing:
            session.close("the coordinator is stopping")
        old = self._sessions.get(session.node_id)
        self._sessions[session.node_id] = session
        if old is not None:
            log.warning(
                "control stream replaced node=%s old_peer=%s new_peer=%s",
                session.node_id,
                old.peer or "-",
                session.peer or "-",
            )
            old.close(
                "a newer Connect with this Node's credential replaced this stream; if this Node "
                "did not open it, its credential is in other hands: revoke it and re-enroll"
            )
        return old

    def detach(self, session: NodeSession) -> bool:
        """Forget ``session``; True when it was still the Node's current one."""
        if self._sessions.get(session.node_id) is session:
            del self._sessions[session.node_id]
            return True
        return False

    def end(self, node_id: str, reason: str) -> bool:
        """Close the Node's live session now (revoked, re-enrolled); False when it had none."""
        session = self._sessions.get(node_id)
        if session is None:
            return False
        log.info("control stream ended node=%s why=%s", node_id, reason)
        session.close(reason)
        return True

    def is_connected(self, node_id: str) -> bool:
        return node_id in self._sessions

    def connected_nodes(self) -> list[str]:
        """The ids of the Nodes with a live session now."""
        return list(self._sessions)

    def nodes_that_take(self, capability: str) -> list[str]:
        """The ids of the Nodes with a live session whose agent announced ``capability``."""
        return [n for n, s in self._sessions.items() if capability in s.capabilities]

    def send(self, node_id: str, message: v1.CoordinatorMessage) -> bool:
        """Queue ``message`` for the Node; False when it has no session (it will ask again)."""
        session = self._sessions.get(node_id)
        return session is not None and session.send(message)

    def dispatch(self, orders: list[Order]) -> None:
        """Send each order to its Node. An order for a disconnected Node is not lost: the
        decision is in the store and the Node gets it again when it reconnects or asks."""
        for order in orders:
            sent = self.send(order.node_id, order_to_wire(order))
            log.info(
                "order %s kind=%s node=%s run_id=%s attempt=%d member=%d",
                "sent" if sent else "deferred until the node connects",
                type(order).__name__,
                order.node_id,
                order.member.run_id,
                order.member.attempt,
                order.member.member_index,
            )

    async def close_all(self) -> None:
        """Close every session and wait for each to finish its bookkeeping."""
        self._closing = True
        sessions = list(self._sessions.values())
        for session in sessions:
            session.close("the coordinator is stopping")
        for session in sessions:
            await session.finished.wait()
