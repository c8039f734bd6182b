"""Credentials: how they are made, how they are stored, how a call presents them.

Rules:
- A credential is random, carries a prefix that says what it is for (``tpa_`` user/admin,
  ``tpj_`` join token, ``tpn_`` Node control credential), and is stored only as its sha256 hash.
- Every call presents ``authorization: Bearer <credential>``; a missing or malformed header is an
  :class:`AuthError` with a sentence that says how to fix it.
- Node control credentials and user tokens have a lifetime and can be revoked: a spent one is
  refused (UNAUTHENTICATED) with a sentence that says what to do, decided here by pure functions
  over what the store recorded (:class:`CredentialLife`) and the time passed in.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Literal

import attrs

USER_PREFIX = "tpa_"
JOIN_PREFIX = "tpj_"
NODE_PREFIX = "tpn_"


class AuthError(Exception):
    """The caller did not present a usable credential (gRPC UNAUTHENTICATED)."""


class PermissionDenied(Exception):
    """The caller is known but may not do this (gRPC PERMISSION_DENIED)."""


@attrs.frozen
class Principal:
    """Who is calling: ``kind`` is "user" or "node"; ``name`` is the user name or the Node id."""

    kind: str
    name: str


def new_credential(prefix: str) -> str:
    """A fresh credential: the prefix and 32 random bytes, URL-safe."""
    return prefix + secrets.token_urlsafe(32)


def hash_credential(credential: str) -> str:
    """The form a credential is stored in: ``sha256:<hex>``."""
    return "sha256:" + hashlib.sha256(credential.encode("utf-8")).hexdigest()


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The credential in ``authorization: Bearer <token>``, or :class:`AuthError`."""
    values = [v for k, v in (metadata or ()) if k.lower() == "authorization"]
    if not values:
        raise AuthError(
            "this call carries no credential. Send `authorization: Bearer <token>` metadata "
            "(tp reads the token file named in its context)."
        )
    value = values[0]
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    scheme, _, token = text.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthError(
            "the authorization metadata is not `Bearer <token>`. Send the token after `Bearer `."
        )
    return token.strip()


#: How long a Node's control credential lives unless ``coordinator.toml`` says otherwise.
DEFAULT_NODE_CREDENTIAL_LIFETIME_S = 30 * 86400
#: How long a user token made by ``tuneplane-coordinator user create`` lives by default.
DEFAULT_USER_TOKEN_LIFETIME_S = 90 * 86400


@attrs.frozen
class CredentialLife:
    """What the store recorded about one credential's life (epoch ms; ``None``: not recorded).

    ``expires_at_ms`` of ``None`` means it does not expire: user tokens made without an expiry
    (the admin token ``init`` writes) and Node credentials issued before credentials expired
    (those get a lifetime at their next Connect).
    """

    issued_at_ms: int | None = None
    expires_at_ms: int | None = None
    revoked_at_ms: int | None = None

    def spent(self, now_ms: int) -> tuple[Literal["revoked", "expired"], int] | None:
        """Why the credential is refused at ``now_ms`` and since when; ``None`` while it is good.

        A revocation wins over an expiry: it is what an operator decided."""
        if self.revoked_at_ms is not None:
            return "revoked", self.revoked_at_ms
        if self.expires_at_ms is not None and self.expires_at_ms <= now_ms:
            return "expired", self.expires_at_ms
        return None


def _utc(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def check_node_credential(node_id: str, life: CredentialLife, now_ms: int) -> None:
    """Refuse a revoked or expired Node control credential with the operator's next step."""
    match life.spent(now_ms):
        case ("revoked", at):
            raise AuthError(
                f"Node {node_id}'s control credential was revoked at {_utc(at)} and is refused. "
                "If this machine should still be a Node, make a join token for it "
                f"(`tuneplane-coordinator token create --node {node_id}`) and run "
                "`tuneplane-node enroll --re-enroll --token <join token>` on that machine."
            )
        case ("expired", at):
            raise AuthError(
                f"Node {node_id}'s control credential expired at {_utc(at)} (it was offline past "
                "its lifetime, so it could not renew it) and is refused. Re-enroll it: make a "
                f"join token for it (`tuneplane-coordinator token create --node {node_id}`) and "
                "run `tuneplane-node enroll --re-enroll --token <join token>` on that machine."
            )


def check_user_token(user: str, life: CredentialLife, now_ms: int) -> None:
    """Refuse a revoked or expired user token with a sentence naming the user and the fix."""
    spent = life.spent(now_ms)
    if spent is not None:
        how, at = spent
        raise AuthError(
            f"the token of user {user!r} {'was revoked' if how == 'revoked' else 'expired'} at "
            f"{_utc(at)}. Ask the coordinator's operator for a new one "
            f"(`tuneplane-coordinator user token {user}`)."
        )
