"""The Api's Fleet and Node calls: ListFleets, GetFleet, ListNodes, GetNode, SetNodeScheduling.

Rules:
- Served on the API listener beside :class:`~tuneplane.coordinator.api.jobs.ApiService`; every
  call is authenticated from its user token before the request is read.
- Any user may read; only a user with the ``admin`` role may change a Node's scheduling, and that
  is checked here, on the server, whatever the client did.
- Values become messages through :mod:`~tuneplane.coordinator.wire.fleet`, nowhere else.
- A Node's last heartbeat is the live one this process heard (the store's copy is written in
  batches and may be one flush interval older).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import attrs
from grpclib import GRPCError
from grpclib.const import Cardinality, Handler, Status

from tuneplane.proto import v1

from ..auth import PermissionDenied, bearer_token, hash_credential
from ..clock import now_ms
from ..executors.slurm import partition_view
from ..faultpoint import faultpoint
from ..gateways.heartbeats import HeartbeatBook
from ..gateways.status import grpc_errors
from ..queue_plan import PoolKey
from ..store import identity as store_identity
from ..store.core import Store
from ..store.fleet_views import fleet_views, node_view, node_views, resolve_node
from ..store.node_scheduling import REQUESTABLE, set_scheduling
from ..values.fleet import Node
from ..values.users import User
from ..wire.fleet import (
    fleet_to_wire,
    fleets_to_wire,
    node_to_wire,
    nodes_to_wire,
)

log = logging.getLogger(__name__)

MAX_REASON = 500


async def caller(store: Store, stream: Any) -> User:
    """The user whose token this call carries, or :class:`AuthError`."""
    token = bearer_token(stream.metadata.items() if stream.metadata else ())
    return await store_identity.authenticate_user(store, hash_credential(token), now_ms())


async def admin_caller(store: Store, stream: Any, may_not: str) -> User:
    """The calling user when it has the admin role; :class:`PermissionDenied` saying it ``may_not``
    (what it tried, as "revoke Nodes") otherwise."""
    user = await caller(store, stream)
    if not user.is_admin:
        raise PermissionDenied(
            f"the user {user.name!r} may not {may_not}; only an admin user may. Ask the "
            "coordinator's operator."
        )
    return user


def require_node_id(node_id: str, message: str) -> None:
    """Refuse an empty ``<message>.node_id``."""
    if not node_id:
        raise GRPCError(Status.INVALID_ARGUMENT, f"{message}.node_id is empty. Name a Node.")


def check_reason(reason: str, message: str) -> None:
    """Refuse a ``<message>.reason`` longer than :data:`MAX_REASON` characters."""
    if len(reason) > MAX_REASON:
        raise GRPCError(
            Status.INVALID_ARGUMENT,
            f"{message}.reason is longer than {MAX_REASON} characters. Shorten it.",
        )


class FleetService:
    """grpclib handlers for the Fleet and Node methods of ``tuneplane.v1.Api``."""

    def __init__(
        self,
        store: Store,
        quotas: Mapping[PoolKey, int],
        on_change: Callable[[], None],
        heartbeats: HeartbeatBook | None = None,
    ) -> None:
        self._store = store
        self._quotas = quotas
        self._on_change = on_change
        self._heartbeats = heartbeats

    def live(self, node: Node) -> Node:
        """``node`` with the last heartbeat this process heard, when it is newer (the console
        shows Nodes through this too)."""
        if self._heartbeats is not None:
            live = self._heartbeats.last(node.id)
            if live > node.last_heartbeat_ms:
                return attrs.evolve(node, last_heartbeat_ms=live)
        return node

    def __mapping__(self) -> dict[str, Handler]:
        def unary(fn: Any, req: type, rep: type) -> Handler:
            return Handler(fn, Cardinality.UNARY_UNARY, req, rep)

        return {
            "/tuneplane.v1.Api/ListFleets": unary(
                self._list_fleets, v1.ListFleetsRequest, v1.ListFleetsReply
            ),
            "/tuneplane.v1.Api/GetFleet": unary(self._get_fleet, v1.GetFleetRequest, v1.Fleet),
            "/tuneplane.v1.Api/ListNodes": unary(
                self._list_nodes, v1.ListNodesRequest, v1.ListNodesReply
            ),
            "/tuneplane.v1.Api/GetNode": unary(self._get_node, v1.GetNodeRequest, v1.Node),
            "/tuneplane.v1.Api/SetNodeScheduling": unary(
                self._set_scheduling, v1.SetNodeSchedulingRequest, v1.Node
            ),
        }

    async def _list_fleets(self, stream: Any) -> None:
        with grpc_errors():
            await caller(self._store, stream)
            await stream.recv_message()
            faultpoint("list-fleets")
            fleets = await fleet_views(self._store, self._quotas)
            await stream.send_message(fleets_to_wire(fleets))

    async def _get_fleet(self, stream: Any) -> None:
        with grpc_errors():
            await caller(self._store, stream)
            request: v1.GetFleetRequest = await stream.recv_message()
            if not request.name:
                raise GRPCError(
                    Status.INVALID_ARGUMENT, "GetFleetRequest.name is empty. Name a Fleet."
                )
            (fleet,) = await fleet_views(self._store, self._quotas, request.name)
            if fleet.kind == "slurm":
                settings = await self._store.slurm_settings(fleet.name)
                if settings is not None:
                    # Asked now, bounded: a slurmrestd that is down makes the view's error
                    # sentence, never a failed GetFleet.
                    fleet = attrs.evolve(fleet, slurm=await partition_view(settings))
            await stream.send_message(fleet_to_wire(fleet))

    async def _list_nodes(self, stream: Any) -> None:
        with grpc_errors():
            await caller(self._store, stream)
            request: v1.ListNodesRequest = await stream.recv_message()
            if request.fleet and request.fleet not in await self._store.fleet_names():
                raise GRPCError(
                    Status.NOT_FOUND,
                    f"there is no Fleet {request.fleet!r}. List the Fleets with `tp fleet ls`.",
                )
            nodes = await node_views(self._store, fleet=request.fleet)
            await stream.send_message(nodes_to_wire([self.live(n) for n in nodes]))

    async def _get_node(self, stream: Any) -> None:
        with grpc_errors():
            await caller(self._store, stream)
            request: v1.GetNodeRequest = await stream.recv_message()
            require_node_id(request.node_id, "GetNodeRequest")
            node_id = await resolve_node(self._store, request.node_id)
            node = await node_view(self._store, node_id)
            await stream.send_message(node_to_wire(self.live(node)))

    async def _set_scheduling(self, stream: Any) -> None:
        with grpc_errors():
            user = await admin_caller(self._store, stream, "cordon, uncordon or drain Nodes")
            request: v1.SetNodeSchedulingRequest = await stream.recv_message()
            if request.scheduling not in REQUESTABLE:
                raise GRPCError(
                    Status.INVALID_ARGUMENT,
                    f"SetNodeSchedulingRequest.scheduling {request.scheduling!r} is not one of "
                    f"{', '.join(REQUESTABLE)}. Use tp node cordon, uncordon or drain.",
                )
            require_node_id(request.node_id, "SetNodeSchedulingRequest")
            check_reason(request.reason, "SetNodeSchedulingRequest")
            node_id = await resolve_node(self._store, request.node_id)
            await set_scheduling(
                self._store,
                node_id,
                request.scheduling,
                user.name,
                request.reason,
                now_ms(),
            )
            # Uncordoning frees capacity; the scheduler should look at the queue again now.
            self._on_change()
            node = await node_view(self._store, node_id)
            await stream.send_message(node_to_wire(self.live(node)))
