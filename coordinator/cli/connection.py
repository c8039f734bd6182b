"""Where ``tp`` finds its coordinator: a context file, overridden piece by piece by flags.

Rules: a flag (or its TUNEPLANE_* variable) wins over the context file; relative paths in a
context file are relative to that file; anything missing or unreadable is a
:class:`ConnectionConfigError` that names the flag and the variable to set.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs

from tuneplane.agent.host_port import join_host_port, split_host_port


@attrs.frozen
class Endpoint:
    """A coordinator API address, the CA that must vouch for it, and the caller's token."""

    host: str
    port: int
    ca_path: Path
    token: str = attrs.field(repr=False)

    @property
    def address(self) -> str:
        return join_host_port(self.host, self.port)


class ConnectionConfigError(Exception):
    """``tp`` cannot tell which coordinator to talk to, or how; ``str()`` says what to set."""


def parse_address(text: str, source: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port), read by
    :func:`tuneplane.agent.host_port.split_host_port`."""
    found = split_host_port(text)
    if found is None:
        raise ConnectionConfigError(
            f"{source} {text!r} is not HOST:PORT; write e.g. 127.0.0.1:7443 or [::1]:7443."
        )
    return found


@attrs.frozen
class _Context:
    coordinator: str | None = None
    ca: Path | None = None
    token_file: Path | None = None


def _read_context(path: Path) -> _Context:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConnectionConfigError(
            f"The context file {path} (--context / TUNEPLANE_CONTEXT) does not exist; the "
            "coordinator writes tp-context.json into its state directory when it serves."
        ) from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConnectionConfigError(
            f"The context file {path} is not readable JSON ({exc}); point --context at the "
            "coordinator's tp-context.json."
        ) from None
    if not isinstance(raw, dict):
        raise ConnectionConfigError(f"The context file {path} must hold a JSON object.")
    values: dict[str, str] = {}
    for key in ("coordinator", "ca", "token_file"):
        value = raw.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or not value:
            raise ConnectionConfigError(f"The context file {path} key '{key}' must be a string.")
        values[key] = value
    base = path.parent

    def local(key: str) -> Path | None:
        return base / values[key] if key in values else None

    return _Context(values.get("coordinator"), local("ca"), local("token_file"))


def resolve_connection(
    context: Path | None,
    coordinator: str | None,
    ca: Path | None,
    token_file: Path | None,
) -> Endpoint:
    """Combine the context file with the flags; every piece must be known in the end."""
    ctx = _read_context(context) if context is not None else _Context()
    address = coordinator or ctx.coordinator
    if address is None:
        raise ConnectionConfigError(
            "No coordinator configured: pass --context FILE (or set TUNEPLANE_CONTEXT) to the "
            "coordinator's tp-context.json, or give --coordinator HOST:PORT "
            "(TUNEPLANE_COORDINATOR)."
        )
    host, port = parse_address(address, "--coordinator" if coordinator else "context coordinator")
    ca_path = ca or ctx.ca
    if ca_path is None:
        raise ConnectionConfigError(
            "No CA configured to verify the coordinator: pass --ca FILE (TUNEPLANE_CA) or "
            "--context FILE (TUNEPLANE_CONTEXT)."
        )
    if not ca_path.is_file():
        raise ConnectionConfigError(
            f"The CA file {ca_path} does not exist; pass --ca with the coordinator's CA "
            "certificate (its state directory holds tls/ca.pem)."
        )
    token_path = token_file or ctx.token_file
    if token_path is None:
        raise ConnectionConfigError(
            "No token configured: pass --token-file FILE (TUNEPLANE_TOKEN_FILE) or "
            "--context FILE (TUNEPLANE_CONTEXT)."
        )
    try:
        token = token_path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConnectionConfigError(
            f"The token file {token_path} cannot be read ({exc.__class__.__name__}: "
            f"{getattr(exc, 'strerror', None) or exc}); check --token-file or the context file."
        ) from None
    if not token or any(c.isspace() for c in token):
        raise ConnectionConfigError(
            f"The token file {token_path} does not hold a token (one line, no spaces); "
            "check --token-file or the context file."
        )
    return Endpoint(host=host, port=port, ca_path=ca_path, token=token)
