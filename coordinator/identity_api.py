"""The Api's credential calls: RevokeNode (admin users only).

Rules:
- Served on the API listener beside the other Api handlers. Revoking is recorded in the decision
  log first, then the Node's live control stream is ended at once; from then on every Connect
  with its credential is refused until the Node is re-enrolled with a new join token.
- Repeating a revocation changes nothing and still ends a live stream (there should be none).
"""

from __future__ import annotations

import logging
from typing import Any

from grpclib import GRPCError
from grpclib.const import Cardinality, Handler, Status

from tuneplane.coordinator import store_fleet, store_identity
from tuneplane.coordinator.auth import PermissionDenied
from tuneplane.coordinator.clock import now_ms
from tuneplane.coordinator.fleet_service import ADMIN_ROLE, MAX_REASON, caller, node_message
from tuneplane.coordinator.sessions import SessionRegistry
from tuneplane.coordinator.store import Store
from tuneplane.coordinator.wire import grpc_errors
from tuneplane.proto import v1

log = logging.getLogger(__name__)


class IdentityApi:
    """grpclib handlers for the credential methods of ``tuneplane.v1.Api``."""

    def __init__(self, store: Store, registry: SessionRegistry) -> None:
        self._store = store
        self._registry = registry

    def __mapping__(self) -> dict[str, Handler]:
        return {
            "/tuneplane.v1.Api/RevokeNode": Handler(
                self._revoke_node, Cardinality.UNARY_UNARY, v1.RevokeNodeRequest, v1.Node
            ),
        }

    async def _revoke_node(self, stream: Any) -> None:
        with grpc_errors():
            user = await caller(self._store, stream)
            if user.role != ADMIN_ROLE:
                raise PermissionDenied(
                    f"the user {user.name!r} may not revoke Nodes; only an admin user may. Ask "
                    "the coordinator's operator."
                )
            request: v1.RevokeNodeRequest = await stream.recv_message()
            if not request.node_id:
                raise GRPCError(
                    Status.INVALID_ARGUMENT, "RevokeNodeRequest.node_id is empty. Name a Node."
                )
            if len(request.reason) > MAX_REASON:
                raise GRPCError(
                    Status.INVALID_ARGUMENT,
                    f"RevokeNodeRequest.reason is longer than {MAX_REASON} characters. Shorten it.",
                )
            changed = await store_identity.revoke_node(
                self._store, request.node_id, user.name, request.reason, now_ms()
            )
            ended = self._registry.end(
                request.node_id,
                "the Node's control credential was revoked; re-enroll it with a new join token",
            )
            log.info(
                "node revoked node=%s by=%s changed=%s live_stream_ended=%s",
                request.node_id,
                user.name,
                changed,
                ended,
            )
            node = await store_fleet.node_view(self._store, request.node_id)
            await stream.send_message(node_message(node))
