"""The Api's Fleet and Node calls: ListFleets, GetFleet, ListNodes, GetNode, SetNodeScheduling.

Rules:
- Served on the API listener beside :class:`~tuneplane.coordinator.api_service.ApiService`; every
  call is authenticated from its user token before the request is read.
- Any user may read; only a user with the ``admin`` role may change a Node's scheduling, and that
  is checked here, on the server, whatever the client did.
- Domain views become betterproto messages here, at the wire edge, and nowhere else.
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

from tuneplane.coordinator import store_fleet, store_identity
from tuneplane.coordinator.auth import PermissionDenied, bearer_token, hash_credential
from tuneplane.coordinator.clock import now_ms
from tuneplane.coordinator.faultpoint import faultpoint
from tuneplane.coordinator.fleetviews import FleetView, NodeView, UserView
from tuneplane.coordinator.heartbeats import HeartbeatBook
from tuneplane.coordinator.queue_plan import PoolKey
from tuneplane.coordinator.records import GpuInfo, InventoryInfo, MemberKey
from tuneplane.coordinator.store import Store
from tuneplane.coordinator.wire import grpc_errors, member_ref
from tuneplane.proto import v1

log = logging.getLogger(__name__)

ADMIN_ROLE = "admin"
MAX_REASON = 500


async def caller(store: Store, stream: Any) -> UserView:
    """The user whose token this call carries, or :class:`AuthError`."""
    token = bearer_token(stream.metadata.items() if stream.metadata else ())
    return await store_identity.authenticate_user(store, hash_credential(token), now_ms())


async def admin_caller(store: Store, stream: Any, may_not: str) -> UserView:
    """The calling user when it has the admin role; :class:`PermissionDenied` saying it ``may_not``
    (what it tried, as "revoke Nodes") otherwise."""
    user = await caller(store, stream)
    if user.role != ADMIN_ROLE:
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


def inventory_message(inv: InventoryInfo) -> v1.Inventory:
    return v1.Inventory(
        hostname=inv.hostname,
        cpu_count=inv.cpu_count,
        memory_bytes=inv.memory_bytes,
        gpus=[_gpu(g) for g in inv.gpus],
        gpu_source=inv.gpu_source,
        driver_version=inv.driver_version,
        cuda_version=inv.cuda_version,
    )


def _gpu(g: GpuInfo) -> v1.Gpu:
    return v1.Gpu(
        index=g.index,
        uuid=g.uuid,
        name=g.name,
        series=g.series,
        memory_bytes=g.memory_bytes,
        mig_enabled=g.mig_enabled,
        healthy=g.healthy,
        health_reason=g.health_reason,
    )


def _node_gpu(g: GpuInfo, holder: MemberKey | None) -> v1.NodeGpu:
    if holder is None:
        return v1.NodeGpu(gpu=_gpu(g))
    return v1.NodeGpu(gpu=_gpu(g), held_by=member_ref(holder))


def node_message(node: NodeView) -> v1.Node:
    return v1.Node(
        id=node.id,
        fleet=node.fleet,
        hostname=node.hostname,
        name=node.name,
        dialed_address=node.dialed_address,
        outputs_address=node.outputs_address,
        scheduling=node.scheduling,
        scheduling_reason=node.scheduling_reason,
        scheduling_changed_at_ms=node.scheduling_changed_at_ms,
        scheduling_changed_by=node.scheduling_changed_by,
        connected=node.connected,
        disconnected_since_ms=node.disconnected_since_ms,
        last_heartbeat_ms=node.last_heartbeat_ms,
        enrolled_at_ms=node.enrolled_at_ms,
        inventory=inventory_message(node.inventory),
        gpus=[_node_gpu(g, node.held_by.get(g.index)) for g in node.inventory.gpus],
        members=[
            v1.NodeMember(
                member=member_ref(m.member),
                state=m.state,
                gpu_indexes=list(m.gpu_indexes),
                owner=m.owner,
            )
            for m in node.members
        ],
        credential_issued_at_ms=node.credential_issued_at_ms,
        credential_expires_at_ms=node.credential_expires_at_ms,
        revoked_at_ms=node.revoked_at_ms,
    )


def fleet_message(fleet: FleetView) -> v1.Fleet:
    return v1.Fleet(
        name=fleet.name,
        kind=fleet.kind,
        created_at_ms=fleet.created_at_ms,
        nodes=fleet.nodes,
        connected_nodes=fleet.connected_nodes,
        schedulable_nodes=fleet.schedulable_nodes,
        capacity=[
            v1.SeriesCapacity(
                series=c.series,
                total=c.total,
                healthy=c.healthy,
                free=c.free,
                in_use=c.in_use,
                quota=c.quota,
            )
            for c in fleet.capacity
        ],
        queued_jobs=fleet.queued_jobs,
        active_jobs=fleet.active_jobs,
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

    def _node_message(self, node: NodeView) -> v1.Node:
        if self._heartbeats is not None:
            live = self._heartbeats.last(node.id)
            if live > node.last_heartbeat_ms:
                node = attrs.evolve(node, last_heartbeat_ms=live)
        return node_message(node)

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
            fleets = await store_fleet.fleet_views(self._store, self._quotas)
            await stream.send_message(v1.ListFleetsReply(fleets=[fleet_message(f) for f in fleets]))

    async def _get_fleet(self, stream: Any) -> None:
        with grpc_errors():
            await caller(self._store, stream)
            request: v1.GetFleetRequest = await stream.recv_message()
            if not request.name:
                raise GRPCError(
                    Status.INVALID_ARGUMENT, "GetFleetRequest.name is empty. Name a Fleet."
                )
            (fleet,) = await store_fleet.fleet_views(self._store, self._quotas, request.name)
            await stream.send_message(fleet_message(fleet))

    async def _list_nodes(self, stream: Any) -> None:
        with grpc_errors():
            await caller(self._store, stream)
            request: v1.ListNodesRequest = await stream.recv_message()
            if request.fleet and request.fleet not in await self._store.fleet_names():
                raise GRPCError(
                    Status.NOT_FOUND,
                    f"there is no Fleet {request.fleet!r}. List the Fleets with `tp fleet ls`.",
                )
            nodes = await store_fleet.node_views(self._store, fleet=request.fleet)
            await stream.send_message(
                v1.ListNodesReply(nodes=[self._node_message(n) for n in nodes])
            )

    async def _get_node(self, stream: Any) -> None:
        with grpc_errors():
            await caller(self._store, stream)
            request: v1.GetNodeRequest = await stream.recv_message()
            require_node_id(request.node_id, "GetNodeRequest")
            node_id = await store_fleet.resolve_node(self._store, request.node_id)
            node = await store_fleet.node_view(self._store, node_id)
            await stream.send_message(self._node_message(node))

    async def _set_scheduling(self, stream: Any) -> None:
        with grpc_errors():
            user = await admin_caller(self._store, stream, "cordon, uncordon or drain Nodes")
            request: v1.SetNodeSchedulingRequest = await stream.recv_message()
            if request.scheduling not in store_fleet.REQUESTABLE:
                raise GRPCError(
                    Status.INVALID_ARGUMENT,
                    f"SetNodeSchedulingRequest.scheduling {request.scheduling!r} is not one of "
                    f"{', '.join(store_fleet.REQUESTABLE)}. Use tp node cordon, uncordon or drain.",
                )
            require_node_id(request.node_id, "SetNodeSchedulingRequest")
            check_reason(request.reason, "SetNodeSchedulingRequest")
            node_id = await store_fleet.resolve_node(self._store, request.node_id)
            await store_fleet.set_scheduling(
                self._store,
                node_id,
                request.scheduling,
                user.name,
                request.reason,
                now_ms(),
            )
            # Uncordoning frees capacity; the scheduler should look at the queue again now.
            self._on_change()
            node = await store_fleet.node_view(self._store, node_id)
            await stream.send_message(self._node_message(node))
