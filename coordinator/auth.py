"""Credentials: how they are made, how they are stored, how a call presents them.

Rules:
- A credential is random, carries a prefix that says what it is for (``tpa_`` user/admin,
  ``tpj_`` join token, ``tpn_`` Node control credential), and is stored only as its sha256 hash.
- Every call presents ``authorization: Bearer <credential>``; a missing or malformed header is an
  :class:`AuthError` with a sentence that says how to fix it.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable

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
