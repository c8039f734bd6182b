"""node.toml's ``[registries."host[:port]"]``: how this Node reaches the registries its runtime
images come from (TLS CA, credentials). Only the agent reads the password files, and only
``run`` reads them at all.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .config_tables import DEFAULT_PATH, NodeConfigError, check_table
from .image_access import RegistryAccess

_REGISTRY_KEYS: Mapping[str, type] = {"ca_file": str, "username": str, "password_file": str}
# A registry as image references name it: a host name or address, an optional port.
_REGISTRY_HOST = re.compile(
    r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?)(:[0-9]{1,5})?$"
)


def registries_settings(
    settings: Mapping[str, Any], path: Path | None = None, *, read_files: bool = True
) -> dict[str, RegistryAccess]:
    """How this Node reaches each registry node.toml names (``[registries."host[:port]"]``):
    ``ca_file`` (a PEM bundle; the system's CAs when unset), ``username`` and ``password_file``.

    The password is read here, by the agent, and only from a file no group or other user can
    read, owned by root or the agent's own user: it never reaches a workload, an argument list
    or a log. ``read_files=False`` checks the keys only (every command reads node.toml; only
    ``run`` reads the secrets).
    """
    where = path or DEFAULT_PATH
    raw = settings.get("registries", {})
    found: dict[str, RegistryAccess] = {}
    for host, table in raw.items():
        name = f'registries."{host}"'
        if not _REGISTRY_HOST.match(host):
            raise NodeConfigError(
                f"{where}: [{name}] does not name a registry; write its host and optional port "
                'as images name it, e.g. [registries."registry.example:5000"].'
            )
        if not isinstance(table, dict):
            raise NodeConfigError(
                f"{where}: '{name}' must be a table ([{name}] with ca_file, username and "
                "password_file)."
            )
        check_table(where, name, table, _REGISTRY_KEYS)
        for key in ("ca_file", "password_file"):
            if key in table and not table[key].startswith("/"):
                raise NodeConfigError(
                    f"{where}: '{name}.{key}' = {table[key]!r} is not an absolute path; give "
                    "the full path of the file."
                )
        if ("username" in table) != ("password_file" in table):
            raise NodeConfigError(
                f"{where}: [{name}] gives {'username' if 'username' in table else 'password_file'}"
                " without "
                f"{'password_file' if 'username' in table else 'username'}; give both, or "
                "neither for a registry that needs no credentials."
            )
        ca_file = Path(table["ca_file"]) if "ca_file" in table else None
        password = None
        if read_files:
            if ca_file is not None and not os.access(ca_file, os.R_OK):
                raise NodeConfigError(
                    f"{where}: '{name}.ca_file' = {str(ca_file)!r} cannot be read by the agent; "
                    "put the registry's CA bundle (PEM) there or fix the path."
                )
            if "password_file" in table:
                password = _read_password(Path(table["password_file"]), where, name)
        found[host] = RegistryAccess(
            ca_file=ca_file, username=table.get("username"), password=password
        )
    return found


def _read_password(file: Path, where: Path, name: str) -> str:
    """The registry password in ``file`` (its first line), refused unless only its owner, root
    or the agent's own user, can read it."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise NodeConfigError(
            f"{where}: '{name}.password_file' = {str(file)!r} cannot be opened "
            f"({exc.strerror}); put the registry password there or fix the path."
        ) from None
    with os.fdopen(fd, "rb") as fh:
        info = os.fstat(fh.fileno())
        if info.st_mode & 0o077:
            raise NodeConfigError(
                f"{where}: '{name}.password_file' = {str(file)!r} can be read by its group or "
                f"other users (mode {info.st_mode & 0o777:04o}); make it readable by its owner "
                f"only: chmod 600 {file}."
            )
        if info.st_uid not in (0, os.geteuid()):
            raise NodeConfigError(
                f"{where}: '{name}.password_file' = {str(file)!r} is owned by uid "
                f"{info.st_uid}, neither root nor the agent's user; chown it to root (or the "
                "agent's user)."
            )
        text = fh.read().decode("utf-8", errors="replace")
    password = text.splitlines()[0] if text else ""
    if not password:
        raise NodeConfigError(
            f"{where}: '{name}.password_file' = {str(file)!r} is empty; write the registry "
            "password on its first line."
        )
    return password
