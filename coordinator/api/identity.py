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

from grpclib.const import Cardinality, Handler

from tuneplane.proto import v1

from ..clock import now_ms
from ..gateways.sessions import SessionRegistry
from ..gateways.status import grpc_errors
from ..store import identity as store_identity
from ..store.core import Store
from ..store.fleet_views import node_view, resolve_node
from ..wire.fleet import node_to_wire
from .fleet import admin_caller, check_reason, require_node_id

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
            user = await admin_caller(self._store, stream, "revoke Nodes")
            request: v1.RevokeNodeRequest = await stream.recv_message()
            require_node_id(request.node_id, "RevokeNodeRequest")
            check_reason(request.reason, "RevokeNodeRequest")
            node_id = await resolve_node(self._store, request.node_id)
            changed = await store_identity.revoke_node(
                self._store, node_id, user.name, request.reason, now_ms()
            )
            ended = self._registry.end(
                node_id,
                "the Node's control credential was revoked; re-enroll it with a new join token",
            )
            log.info(
                "node revoked node=%s by=%s changed=%s live_stream_ended=%s",
                node_id,
                user.name,
                changed,
                ended,
            )
            node = await node_view(self._store, node_id)
            await stream.send_message(node_to_wire(node))
