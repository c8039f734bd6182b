"""What a conversion raises when a message breaks the protocol.

Rules: light on purpose (no grpclib, no store): ``tp``'s client imports the wire modules that
raise it. :func:`.status.grpc_errors` turns it into INVALID_ARGUMENT on a server.
"""

from __future__ import annotations


class BadMessage(ValueError):
    """A message the protocol does not allow (gRPC INVALID_ARGUMENT); ``str()`` is a sentence
    naming the field, what is wrong and how to fix it."""
