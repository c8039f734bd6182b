"""When the Node renews its control credential (pure: times and jitter in, times out).

Rules:
- Renew at a jittered point in the second half of the lifetime: between 50 % and 90 % of it
  (SPIRE renews at half-life, kubelet between 70 % and 90 %). Jitter spreads a Fleet enrolled
  together over the window, and the last tenth is left for retries before expiry.
- A credential whose lifetime the coordinator did not state (``expires_at_ms`` 0: a coordinator
  without rotation) is never renewed; one already past its window is renewed at once.
- ``doctor`` warns once a credential is past :func:`renewal_deadline_ms` (90 %): by then a healthy
  agent has renewed it.
"""

from __future__ import annotations

RENEW_FROM = 0.5
RENEW_UNTIL = 0.9


def renewal_at_ms(issued_at_ms: int, expires_at_ms: int, jitter: float) -> int | None:
    """The wall time (epoch ms) to ask for a successor, ``jitter`` uniform in [0, 1); ``None``
    when the lifetime is not known (nothing to renew)."""
    if expires_at_ms <= 0:
        return None
    if expires_at_ms <= issued_at_ms:
        return issued_at_ms
    jitter = min(max(jitter, 0.0), 1.0)
    life = expires_at_ms - issued_at_ms
    fraction = RENEW_FROM + (RENEW_UNTIL - RENEW_FROM) * jitter
    return issued_at_ms + int(life * fraction)


def renewal_deadline_ms(issued_at_ms: int, expires_at_ms: int) -> int:
    """The latest a healthy agent renews (90 % of the lifetime); 0 for an unknown lifetime."""
    if expires_at_ms <= 0 or expires_at_ms <= issued_at_ms:
        return 0
    return issued_at_ms + int((expires_at_ms - issued_at_ms) * RENEW_UNTIL)


def _span(ms: int) -> str:
    """A duration for people: 3d 4h, 5h 12m, 40 s."""
    seconds = max(0, ms) // 1000
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    if minutes:
        return f"{minutes}m {secs}s"
    return f"{secs} s"


def credential_health(issued_at_ms: int, expires_at_ms: int, now_ms: int) -> tuple[str, str]:
    """``("ok" | "warn" | "fail", sentence)`` about the control credential's age and expiry."""
    if expires_at_ms <= 0:
        return (
            "warn",
            "control credential lifetime unknown (the coordinator has not stated it yet); the "
            "agent renews it at its next connection",
        )
    age = f"issued {_span(now_ms - issued_at_ms)} ago" if issued_at_ms else "issue time unknown"
    if expires_at_ms <= now_ms:
        return (
            "fail",
            f"control credential EXPIRED {_span(now_ms - expires_at_ms)} ago ({age}); the "
            "coordinator refuses it. Re-enroll this Node: `tuneplane-node enroll --re-enroll "
            "--token <join token>` with a token from `tuneplane-coordinator token create --node "
            "<node id>`",
        )
    deadline = renewal_deadline_ms(issued_at_ms, expires_at_ms)
    if now_ms >= deadline:
        return (
            "warn",
            f"control credential {age}, expires in {_span(expires_at_ms - now_ms)}, and is past "
            "its renewal point: the agent should have renewed it. Check that it is connected "
            "(`tuneplane-node status`) and its log",
        )
    return "ok", f"control credential {age}, expires in {_span(expires_at_ms - now_ms)}"
