"""A Node's control credential on the Connect stream: who is calling, and its rotation.

Rules:
- Connect is authenticated by the Node's control credential only; a collector credential, a
  revoked or an expired one is refused before Hello is read.
- Control credentials expire and rotate (:mod:`~tuneplane.coordinator.store.identity`): Welcome
  says when the stream's credential expires; a CredentialRenewal gets a successor that works
  beside the old one until the Node says CredentialStored or connects with it. A stream does not
  outlive its credential, even if the Node never renews.
"""

from __future__ import annotations

import logging
from typing import Any

from tuneplane.proto import v1

from ..auth import (
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
from ..store import identity as store_identity
from ..store.core import Store
from ..values.fleet import NodeRecord
from .collector_credentials import is_collector_credential
from .sessions import SessionRegistry

log = logging.getLogger(__name__)


class NodeCredentials:
    """The control credentials of connected Nodes: checks them on Connect, expires their
    streams, and hands out and confirms successors."""

    def __init__(self, store: Store, registry: SessionRegistry, lifetime_s: int) -> None:
        self._store = store
        self._registry = registry
        self.lifetime_ms = lifetime_s * 1000
        # node id -> (request id, hash) of the successor credential handed out on its stream.
        self._issued: dict[str, tuple[int, str]] = {}
        # node id -> when the credential its live stream uses expires (epoch ms): a stream does
        # not outlive its credential, even if the Node never renews.
        self._expires: dict[str, int] = {}

    async def authenticate(self, stream: Any) -> tuple[NodeRecord, CredentialLife]:
        """The Node whose control credential opened ``stream``, and that credential's life."""
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
            life = CredentialLife(now, now + self.lifetime_ms)
            await store_identity.start_lifetime(
                self._store, match.node.id, now, life.expires_at_ms or 0
            )
        return match.node, life

    def opened(self, node_id: str, life: CredentialLife) -> None:
        """A stream of ``node_id`` runs on a credential with ``life``."""
        if life.expires_at_ms is not None:
            self._expires[node_id] = life.expires_at_ms

    def closed(self, node_id: str) -> None:
        """The Node's live stream ended (and no newer one replaced it)."""
        self._expires.pop(node_id, None)

    def reenrolled(self, node_id: str) -> None:
        """The Node was re-enrolled: a successor handed out on its old stream is void."""
        self._issued.pop(node_id, None)

    def expired(self, node_id: str, now: int) -> bool:
        """Whether the credential of the Node's live stream has expired at ``now``."""
        return now >= self._expires.get(node_id, now + 1)

    async def renew(self, node_id: str, request_id: int, now: int) -> None:
        """Hand out a successor credential; the old one keeps working until it is confirmed."""
        credential = new_credential(NODE_PREFIX)
        expires = now + self.lifetime_ms
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

    async def stored(self, node_id: str, request_id: int, now: int) -> None:
        """The Node says it stored the successor of ``request_id``: the old credential retires."""
        issued = self._issued.get(node_id)
        if issued is not None and issued[0] == request_id:
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
