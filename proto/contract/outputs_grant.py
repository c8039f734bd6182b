"""The grant that lets one Node fetch another Node's outputs for a Derivation.

Rules:
- The coordinator makes a grant when it sends a Prepare whose source another Node holds
  (:mod:`tuneplane.coordinator.gateways.outputs_grants`), signed with that holder's grant key for
  one source member until an expiry; the holder checks it before serving a byte
  (:mod:`tuneplane.agent.outputs_server`). Both sides sign the same bytes (:func:`grant_message`).
- A grant is HMAC-SHA256 (hex) over the source member and the expiry, compared in constant time.
- Part of the protocol's contract (:mod:`tuneplane.proto.contract`): pure, and imports nothing
  from the coordinator, the agent, the collector or the runner.
"""

from __future__ import annotations

import hashlib
import hmac

GRANT_KEY_BYTES = 32
_GRANT_CONTEXT = b"tuneplane outputs grant v1\x00"


def grant_message(run_id: str, attempt: int, member_index: int, expires_at_ms: int) -> bytes:
    """The bytes a grant signs: the source member and the expiry, unambiguously separated."""
    return _GRANT_CONTEXT + "\x00".join(
        (run_id, str(int(attempt)), str(int(member_index)), str(int(expires_at_ms)))
    ).encode("utf-8")


def make_grant(key: bytes, run_id: str, attempt: int, member_index: int, expires_at_ms: int) -> str:
    """The grant (hex) that lets its bearer fetch the outputs of one source member from the
    Node whose grant key is ``key``, until ``expires_at_ms``."""
    if len(key) != GRANT_KEY_BYTES:
        raise ValueError(f"a grant key is {GRANT_KEY_BYTES} bytes, not {len(key)}")
    return hmac.new(
        key, grant_message(run_id, attempt, member_index, expires_at_ms), hashlib.sha256
    ).hexdigest()


def grant_valid(
    key: bytes,
    grant: str,
    run_id: str,
    attempt: int,
    member_index: int,
    expires_at_ms: int,
    now_ms: int,
) -> bool:
    """Whether ``grant`` is the holder's own for that member and has not expired at ``now_ms``
    (compared in constant time)."""
    if now_ms >= expires_at_ms or len(key) != GRANT_KEY_BYTES:
        return False
    expected = make_grant(key, run_id, attempt, member_index, expires_at_ms)
    return hmac.compare_digest(expected, grant)
