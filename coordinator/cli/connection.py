"""Where ``tp`` finds its coordinators: a context file, overridden piece by piece by flags.

Rules: a flag (or its TUNEPLANE_* variable) wins over the context file; relative paths in a
context file are relative to that file; anything missing or unreadable is a
:class:`ConnectionConfigError` that names the flag and the variable to set. Coordinators that
share one store are several API addresses (``--coordinator A,B`` or the context file's
``api_addresses``), tried in order by :mod:`.api_client`; one malformed entry refuses them all.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs

from tuneplane.agent.host_port import join_host_port, split_host_port

#: Beside the context file (``tp-context.json.leader``): the API address that last answered a
#: ``tp`` using it, one line, so the next ``tp`` starts with the leader and not with a coordinator
#: whose host died (that costs a connection deadline). Best effort: unwritable, it is skipped.
LEADER_SUFFIX = ".leader"
#: How long a call keeps trying several coordinators before it gives up (a takeover takes a few
#: seconds); ``--ride-out`` / TUNEPLANE_RIDE_OUT changes it.
RIDE_OUT_S = 15.0
_EXAMPLE = "write e.g. 127.0.0.1:7443 or [::1]:7443"


@attrs.frozen
class Endpoint:
    """The coordinators' API addresses, the CA that must vouch for them, and the caller's
    token. ``host``/``port`` are the first address; ``others`` the rest (``HOST:PORT``), asked
    in order when one does not answer."""

    host: str
    port: int
    ca_path: Path
    token: str = attrs.field(repr=False)
    others: tuple[str, ...] = ()
    ride_out_s: float = RIDE_OUT_S
    #: Where the address that answered is kept for the next ``tp`` (None: nowhere), and the one
    #: it held (one of :attr:`addresses`; "" when none).
    leader_file: Path | None = None
    last_leader: str = ""

    @property
    def address(self) -> str:
        return join_host_port(self.host, self.port)

    @property
    def addresses(self) -> tuple[str, ...]:
        """Every API address, the first first."""
        return (self.address, *self.others)


class ConnectionConfigError(Exception):
    """``tp`` cannot tell which coordinator to talk to, or how; ``str()`` says what to set."""


def parse_address(text: str, source: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port), read by
    :func:`tuneplane.agent.host_port.split_host_port`."""
    found = split_host_port(text)
    if found is None:
        raise ConnectionConfigError(f"{source} {text!r} is not HOST:PORT; {_EXAMPLE}.")
    return found


def parse_addresses(entries: list[str], source: str) -> tuple[str, ...]:
    """Each entry as ``HOST:PORT`` (written one way), in order, a repeat dropped. ``source``
    names where they were written ("--coordinator", "The context file F key 'api_addresses'"),
    so the sentence for a bad entry says where to fix it."""
    if not entries:
        raise ConnectionConfigError(f"{source} names no address; {_EXAMPLE}.")
    found: list[str] = []
    several = len(entries) > 1
    for entry in entries:
        text = entry.strip()
        if not text:
            raise ConnectionConfigError(
                f"{source} has an empty entry; separate the addresses with single commas, "
                "e.g. 10.0.0.5:7443,10.0.0.6:7443."
            )
        address = join_host_port(*parse_address(text, f"{source} entry" if several else source))
        if address not in found:
            found.append(address)
    return tuple(found)


def leader_path(context: Path) -> Path:
    """The file beside ``context`` that keeps the address that last answered."""
    return context.with_name(context.name + LEADER_SUFFIX)


def read_leader(path: Path, addresses: tuple[str, ...]) -> str:
    """The address ``path`` keeps, if it is one of ``addresses``; else "" (a missing, unreadable
    or stale file is no error: the list is asked in its own order)."""
    try:
        found = split_host_port(path.read_text(encoding="utf-8").strip())
    except (OSError, UnicodeDecodeError):
        return ""
    address = join_host_port(*found) if found is not None else ""
    return address if address in addresses else ""


def split_list(text: str) -> list[str]:
    """``--coordinator`` text: addresses separated by commas."""
    return text.split(",")


@attrs.frozen
class _Context:
    coordinators: tuple[str, ...] = ()
    ca: Path | None = None
    token_file: Path | None = None


def _addresses(path: Path, raw: dict[str, object], first: str | None) -> tuple[str, ...]:
    """The context file's ``coordinator`` (the coordinator that wrote it) then its
    ``api_addresses`` (every coordinator sharing the store, for readers that follow the leader;
    older files have none)."""
    found = parse_addresses([first], f"The context file {path} key 'coordinator'") if first else ()
    listed = raw.get("api_addresses")
    if listed is None:
        return found
    if not isinstance(listed, list) or not all(isinstance(e, str) for e in listed):
        raise ConnectionConfigError(
            f"The context file {path} key 'api_addresses' must be a list of HOST:PORT strings."
        )
    if not listed:
        return found
    more = parse_addresses([str(e) for e in listed], f"The context file {path} key 'api_addresses'")
    return found + tuple(a for a in more if a not in found)


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

    coordinators = _addresses(path, raw, values.get("coordinator"))
    return _Context(coordinators, local("ca"), local("token_file"))


def resolve_connection(
    context: Path | None,
    coordinator: str | None,
    ca: Path | None,
    token_file: Path | None,
    ride_out_s: float = RIDE_OUT_S,
) -> Endpoint:
    """Combine the context file with the flags; every piece must be known in the end.
    ``coordinator`` (``--coordinator``) is one address or several separated by commas."""
    ctx = _read_context(context) if context is not None else _Context()
    if coordinator:
        addresses = parse_addresses(split_list(coordinator), "--coordinator")
    else:
        addresses = ctx.coordinators
    if not addresses:
        raise ConnectionConfigError(
            "No coordinator configured: pass --context FILE (or set TUNEPLANE_CONTEXT) to the "
            "coordinator's tp-context.json, or give --coordinator HOST:PORT[,HOST:PORT...] "
            "(TUNEPLANE_COORDINATOR)."
        )
    host, port = parse_address(addresses[0], "--coordinator")
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
    # Only a list read from a context file is followed across tp processes.
    leader_file = leader_path(context) if context and not coordinator and addresses[1:] else None
    last = read_leader(leader_file, addresses) if leader_file is not None else ""
    return Endpoint(host, port, ca_path, token, addresses[1:], ride_out_s, leader_file, last)
