"""Typed errors -> HTTP status, once, at the edge of the console.

Rules: every console handler runs inside :func:`http_errors`, which runs the coordinator's one
translator (:func:`~tuneplane.coordinator.gateways.status.grpc_errors`) and maps the status it
chose to HTTP, so a refusal means the same on the console as in ``tp``, with the same sentence.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from grpclib import GRPCError
from grpclib.const import Status

from ..gateways.status import grpc_errors

_HTTP = {
    Status.INVALID_ARGUMENT: 400,
    Status.UNAUTHENTICATED: 401,
    Status.PERMISSION_DENIED: 403,
    Status.NOT_FOUND: 404,
    Status.FAILED_PRECONDITION: 409,
    Status.ALREADY_EXISTS: 409,
    Status.RESOURCE_EXHAUSTED: 429,
    Status.UNAVAILABLE: 503,
}


class ConsoleError(Exception):
    """A refusal the console answers with ``status`` and a sentence."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@contextmanager
def http_errors() -> Iterator[None]:
    """Run a console handler; a typed error leaves as :class:`ConsoleError`."""
    refused: list[ConsoleError] = []
    try:
        with grpc_errors():
            try:
                yield
            except ConsoleError as exc:
                refused.append(exc)  # already chosen: not an unexpected error
    except GRPCError as exc:
        raise ConsoleError(_HTTP.get(exc.status, 500), exc.message or str(exc)) from None
    if refused:
        raise refused[0]
