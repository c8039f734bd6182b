"""What a call to the coordinator can fail with, as ``tp`` tells it: typed errors whose ``str()``
is a sentence.

Rules: nothing here imports grpclib or betterproto, so commands that never talk to the
coordinator (init, new, recipe) start fast; :mod:`.api_client` translates every failed call into
one of these, once.
"""

from __future__ import annotations


class ApiError(Exception):
    """A call to the coordinator did not succeed; ``str()`` says why and what to do."""


class RequestRefused(ApiError):
    """The coordinator answered and refused the request; ``str()`` is its sentence."""

    def __init__(self, status: str, message: str) -> None:
        self.status = status
        super().__init__(message)


class NotServed(ApiError):
    """The coordinator does not serve this call (UNIMPLEMENTED: it is older than this ``tp``);
    the caller does the same another way (WatchJob: it polls GetJob)."""


class CoordinatorUnreachable(ApiError):
    """No answer: the address is wrong, the coordinator is down, TLS failed or time ran out."""


class ClientConfigError(ApiError):
    """The CA file cannot be used to set up TLS."""
