"""``tuneplane.v1.Control/Enroll``: a join token spent for a Node id and a control credential.

Rules:
- Enroll spends a single-use, unexpired join token and hands out a fresh Node id and a random
  control credential (stored hashed).
- Enroll is the one call anyone may make: each address gets a token bucket, and a flood is
  refused before the request is read.
- Re-enrolment (the request names its Node id, proven by a join token of its Fleet issued for it)
  keeps the Node's id and members, voids its old credential and ends its live stream.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from typing import Any

from grpclib import GRPCError
from grpclib.const import Status

from tuneplane.proto import v1

from ..auth import NODE_PREFIX, AuthError, hash_credential, new_credential
from ..clock import now_ms
from ..store import identity as store_identity
from ..store.core import Store
from ..wire.control import inventory_from_wire
from .node_credentials import NodeCredentials
from .rate_limit import PeerRateLimit, peer_host
from .sessions import SessionRegistry
from .status import grpc_errors

log = logging.getLogger(__name__)


class EnrollHandler:
    """The Enroll call of the control gateway."""

    def __init__(
        self,
        store: Store,
        registry: SessionRegistry,
        credentials: NodeCredentials,
        limit: PeerRateLimit,
    ) -> None:
        self._store = store
        self._registry = registry
        self._credentials = credentials
        self._limit = limit

    def _refuse_flood(self, stream: Any) -> None:
        """RESOURCE_EXHAUSTED, before the request is read, for an address over its Enroll rate."""
        peer = peer_host(stream.peer.addr() if stream.peer is not None else None)
        wait = self._limit.take(peer, time.monotonic())
        if wait > 0:
            log.warning("enroll refused: rate limit peer=%s retry_after_s=%.1f", peer, wait)
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED,
                f"Too many Enroll calls from {peer}; retry in {math.ceil(wait)} s (the "
                "coordinator's [limits] enroll_burst and enroll_per_second).",
            )

    async def enroll(self, stream: Any) -> None:
        """The grpclib handler of ``/tuneplane.v1.Control/Enroll``."""
        with grpc_errors():
            self._refuse_flood(stream)
            request: v1.EnrollRequest = await stream.recv_message()
            if not request.join_token:
                raise AuthError(
                    "EnrollRequest.join_token is empty. Pass the join token from "
                    "`tuneplane-coordinator token create` to `tuneplane-node enroll`."
                )
            credential = new_credential(NODE_PREFIX)
            inventory = inventory_from_wire(request.inventory, request.hostname)
            now = now_ms()
            expires = now + self._credentials.lifetime_ms
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
                self._credentials.reenrolled(node_id)
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
