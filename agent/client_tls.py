"""The TLS every gRPC client of the coordinator speaks: the Node's control stream, ``doctor``, the
collector's shipper, ``tp`` (and the tests and benches that dial it).

Rules:
- The coordinator's certificate is verified against the CA file given, and its name against
  the address dialed; there is deliberately no way to turn either off (DESIGN.md, "Identity and
  security": server TLS verification is always on).
- TLS 1.2 or newer; ALPN ``h2``, as gRPC needs.
- A CA file that cannot be loaded is a :class:`CaFileError` whose ``str()`` names the file, what
  was wrong and what to pass instead; callers wrap it in their own error type, adding where the
  file is set (``--ca``, node.json).
- Shared runtime infrastructure: it lives in the agent, the lowest layer every client imports.
"""

from __future__ import annotations

import ssl
from pathlib import Path


class CaFileError(ValueError):
    """The CA file cannot be loaded; ``str()`` names it, says why and what to pass instead."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(
            f"The CA file {path} cannot be loaded ({reason}); it must be a PEM certificate such "
            "as the coordinator's tls/ca.pem."
        )


def grpc_client_context(ca_path: Path) -> ssl.SSLContext:
    """A client context that verifies the coordinator against ``ca_path`` and speaks HTTP/2."""
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca_path))
    except (OSError, ssl.SSLError) as exc:
        raise CaFileError(ca_path, f"{type(exc).__name__}: {exc}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["h2"])
    return ctx
