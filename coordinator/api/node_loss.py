"""Carrying out a Node's loss: the Api's DeclareNodeLost (admin) and the ``max_disconnect`` watch.

Rules:
- Both go through :class:`NodeLossDesk`: the declaration is on disk
  (:func:`~tuneplane.coordinator.store.lost_nodes.declare_node_lost`) before any order leaves; then
  the other Nodes get their Cancel or Abort, the lost members' collector credentials start their
  drain window, and the scheduler looks at the queue again (GPUs went back).
- DeclareNodeLost is for admin users only, checked here whatever the client did, and refuses a
  Node this coordinator holds a live stream of.
- The watch runs only when some Fleet sets ``max_disconnect`` and counts a Node's silence from
  this process's start at the earliest (:func:`~tuneplane.coordinator.node_loss.overdue`). A look
  that cannot reach the store is logged and tried again at the next tick.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import anyio
from grpclib import GRPCError
from grpclib.const import Cardinality, Handler, Status

from tuneplane.proto import v1

from .. import node_loss
from ..clock import now_ms
from ..config import FleetSettings
from ..gateways.collector_credentials import CollectorCredentials
from ..gateways.sessions import SessionRegistry
from ..gateways.status import grpc_errors
from ..store.core import Conflict, Store
from ..store.fleet_views import node_view, resolve_node
from ..store.handle import StoreUnavailable
from ..store.lost_nodes import NodeLoss, declare_node_lost, disconnected_holders
from ..values.lifecycle import NodeLossOutcome
from ..wire.lifecycle import node_loss_to_wire
from .fleet import admin_caller, check_reason, require_node_id

log = logging.getLogger(__name__)

WATCH_TICK_S = 1.0


class NodeLossDesk:
    """Declares Nodes lost and sends what follows from it."""

    def __init__(
        self,
        store: Store,
        registry: SessionRegistry,
        wake_scheduler: Callable[[], None],
        collectors: CollectorCredentials | None = None,
    ) -> None:
        self._store = store
        self._registry = registry
        self._wake = wake_scheduler
        self._collectors = collectors

    async def declare(self, node_id: str, by: str, reason: str) -> NodeLoss:
        """Declare ``node_id`` lost (refused while it is connected); returns what changed."""
        now = now_ms()
        loss = await declare_node_lost(
            self._store, node_id, by, reason, now, connected=self._registry.is_connected(node_id)
        )
        self._registry.dispatch(list(loss.orders))
        if self._collectors is not None:
            for member in loss.lost:
                await self._collectors.member_ended(member, now)
        if loss.changed:
            self._wake()
        return loss


class NodeLossApi:
    """grpclib handler for ``tuneplane.v1.Api/DeclareNodeLost``."""

    def __init__(self, store: Store, desk: NodeLossDesk) -> None:
        self._store = store
        self._desk = desk

    def __mapping__(self) -> dict[str, Handler]:
        return {
            "/tuneplane.v1.Api/DeclareNodeLost": Handler(
                self._declare,
                Cardinality.UNARY_UNARY,
                v1.DeclareNodeLostRequest,
                v1.DeclareNodeLostReply,
            ),
        }

    async def _declare(self, stream: Any) -> None:
        with grpc_errors():
            user = await admin_caller(self._store, stream, "declare Nodes lost")
            request: v1.DeclareNodeLostRequest = await stream.recv_message()
            require_node_id(request.node_id, "DeclareNodeLostRequest")
            check_reason(request.reason, "DeclareNodeLostRequest")
            if not request.reason.strip():
                raise GRPCError(
                    Status.INVALID_ARGUMENT,
                    "DeclareNodeLostRequest.reason is empty. Say how you know the machine is "
                    "off; it goes into the decision log.",
                )
            node_id = await resolve_node(self._store, request.node_id)
            loss = await self._desk.declare(node_id, user.name, request.reason)
            node = await node_view(self._store, node_id)
            jobs = tuple([await self._store.get_job(run_id) for run_id in loss.runs])
            await stream.send_message(node_loss_to_wire(NodeLossOutcome(node, loss.lost, jobs)))


class MaxDisconnectWatch:
    """Declares lost, as :data:`~tuneplane.coordinator.node_loss.MAX_DISCONNECT_ACTOR`, every
    Node that holds members and has been disconnected longer than its Fleet's max_disconnect."""

    def __init__(
        self,
        store: Store,
        registry: SessionRegistry,
        desk: NodeLossDesk,
        fleets: Mapping[str, FleetSettings],
        tick_s: float = WATCH_TICK_S,
        started_ms: int | None = None,
    ) -> None:
        self._store = store
        self._registry = registry
        self._desk = desk
        self._limits = {name: f for name, f in fleets.items() if f.max_disconnect_s is not None}
        self._tick_s = tick_s
        # When this coordinator began to hear Nodes: silence before it is not counted.
        self._started_ms = now_ms() if started_ms is None else started_ms

    @property
    def enabled(self) -> bool:
        return bool(self._limits)

    async def run(self) -> None:
        """Look every tick until cancelled; does nothing at all when no Fleet sets a limit."""
        if not self.enabled:
            return
        for name, fleet in sorted(self._limits.items()):
            log.info(
                "max_disconnect on fleet=%s max_disconnect=%s", name, fleet.max_disconnect_text
            )
        while True:
            try:
                await self.step()
            except StoreUnavailable as exc:
                log.warning("max_disconnect look failed; the next tick tries again reason=%s", exc)
            await anyio.sleep(self._tick_s)

    async def step(self) -> list[str]:
        """One look; returns the Nodes it declared lost."""
        declared: list[str] = []
        now = now_ms()
        for node in await disconnected_holders(self._store, sorted(self._limits)):
            fleet = self._limits[node.fleet]
            assert fleet.max_disconnect_s is not None
            if self._registry.is_connected(node.node_id) or not node_loss.overdue(
                node.disconnected_since_ms, self._started_ms, now, fleet.max_disconnect_s * 1000
            ):
                continue
            reason = node_loss.max_disconnect_reason(fleet.max_disconnect_text, fleet.name)
            try:
                loss = await self._desk.declare(
                    node.node_id, node_loss.MAX_DISCONNECT_ACTOR, reason
                )
            except Conflict as exc:
                # It connected between the look and the declaration: it speaks for itself.
                log.info("max_disconnect skipped node=%s why=%s", node.node_id, exc)
                continue
            log.warning(
                "node declared lost by max_disconnect node=%s fleet=%s members=%d",
                node.node_id, fleet.name, len(loss.lost),
            )  # fmt: skip
            declared.append(node.node_id)
        return declared
