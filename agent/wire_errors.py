"""The agent's wire errors: what talking to the coordinator can end in, each ``str()`` a sentence
for the operator.

Their own module, free of grpclib, so a command that only reports them (``cli_support``) loads
none of the gRPC stack; :mod:`.wire` raises them and re-exports them.
"""

from __future__ import annotations


class WireError(Exception):
    """Talking to the coordinator failed. ``str()`` is a sentence for the operator."""


class CoordinatorUnreachable(WireError):
    """No connection (refused, reset, timed out); worth retrying with backoff."""


class CoordinatorBusy(CoordinatorUnreachable):
    """The coordinator is welcoming too many Nodes at once: dial again in :attr:`come_back_s`
    seconds, the turn it named (coordinator/hello_gate.py), or after the backoff when it named
    none (None)."""

    def __init__(self, message: str, come_back_s: float | None) -> None:
        super().__init__(message)
        self.come_back_s = come_back_s


class TlsVerificationFailed(WireError):
    """The coordinator's certificate does not verify against the CA file; retrying won't help."""


class Refused(WireError):
    """The coordinator answered and said no (bad token, unknown Node, revoked credential)."""

    def __init__(self, message: str, status: str) -> None:
        super().__init__(message)
        self.status = status


class UnknownMessage(WireError):
    """The coordinator sent a message this agent does not know (a newer protocol)."""
