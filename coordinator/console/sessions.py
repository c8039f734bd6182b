"""Console sign-ins: server-side sessions, each with its own CSRF token.

Rules:
- Pure: nothing here reads a clock or the store; ``now_ms`` is passed in. The book remembers
  whose token a session was opened with (its hash, as the store keeps it), never the token, so
  every request authenticates that hash again through the store: a revoked or expired token
  ends its sessions at once, and a changed role applies at the next request.
- Server-side, not signed cookies: signing out (or a restart) ends a session for good, and there
  is no signing key to keep, rotate or leak. The price: sessions live in this process's memory,
  so a restart or a takeover asks people to sign in again.
- Bounded: at most :data:`MAX_SESSIONS`; opening one more drops the one that expires first.
  A session id and a CSRF token are 32 random bytes each; the book is keyed by the id's hash,
  and CSRF tokens are compared in constant time.
"""

from __future__ import annotations

import hashlib
import secrets

import attrs

#: How many sign-ins the console remembers at once; past it the one expiring first is dropped.
MAX_SESSIONS = 10_000


@attrs.frozen
class Session:
    """One sign-in: the session id (the cookie's value), the token hash it was opened with, the
    user it named then, its CSRF token and when it expires (epoch ms)."""

    session_id: str = attrs.field(repr=False)
    token_hash: str = attrs.field(repr=False)
    user: str
    csrf_token: str = attrs.field(repr=False)
    expires_at_ms: int

    def csrf_matches(self, presented: str) -> bool:
        """True when ``presented`` is this session's CSRF token (constant-time comparison)."""
        return bool(presented) and secrets.compare_digest(
            presented.encode("utf-8", "replace"), self.csrf_token.encode("utf-8")
        )


def _key(session_id: str) -> str:
    return hashlib.sha256(session_id.encode("utf-8", "replace")).hexdigest()


@attrs.define(eq=False)
class SessionBook:
    """The console's live sessions."""

    lifetime_ms: int
    max_sessions: int = MAX_SESSIONS
    _sessions: dict[str, Session] = attrs.field(factory=dict, alias="sessions")

    def open(self, user: str, token_hash: str, now_ms: int) -> Session:
        """A fresh session for ``user``, signed in with the token whose hash is ``token_hash``."""
        self._sweep(now_ms)
        while len(self._sessions) >= self.max_sessions:
            first = min(self._sessions, key=lambda k: self._sessions[k].expires_at_ms)
            del self._sessions[first]
        session = Session(
            session_id=secrets.token_urlsafe(32),
            token_hash=token_hash,
            user=user,
            csrf_token=secrets.token_urlsafe(32),
            expires_at_ms=now_ms + self.lifetime_ms,
        )
        self._sessions[_key(session.session_id)] = session
        return session

    def find(self, session_id: str, now_ms: int) -> Session | None:
        """The live session with this id; None for an unknown, closed or expired one."""
        if not session_id:
            return None
        key = _key(session_id)
        session = self._sessions.get(key)
        if session is None:
            return None
        if session.expires_at_ms <= now_ms:
            del self._sessions[key]
            return None
        return session

    def close(self, session_id: str) -> bool:
        """End a session (signing out); False when there was none."""
        return self._sessions.pop(_key(session_id), None) is not None

    def __len__(self) -> int:
        return len(self._sessions)

    def _sweep(self, now_ms: int) -> None:
        for key in [k for k, s in self._sessions.items() if s.expires_at_ms <= now_ms]:
            del self._sessions[key]
