"""A Fleet's registries in coordinator.toml (``[fleet.<name>.registries."<host[:port]>"]``): how
Preview reaches the registries its Jobs' images come from (coordinator/image_pin.py).

Rules: as every table of coordinator.toml (coordinator/config/tables.py), a mistake is a
:class:`~tuneplane.coordinator.config.values.ConfigError` naming the file, the key and the fix;
paths are absolute; a username comes with a password file, and the password stays in the file.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tuneplane.agent.image_ref import is_registry

from .values import DEFAULT_REGISTRY_TIMEOUT_S, ConfigError, RegistrySettings, check_keys

_REGISTRY_KEYS = {"ca_file", "username", "password_file", "timeout_s"}


def read_registries(raw: object, fleet: str, path: Path) -> dict[str, RegistrySettings]:
    """``[<fleet>.registries."<host[:port]>"]`` tables: ``ca_file``, ``username`` with
    ``password_file``, and ``timeout_s``; every one optional, the paths absolute."""
    example = f'[{fleet}.registries."registry.example.org:5000"]'
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{path}: {fleet}.registries must hold tables, one per registry: {example}."
        )
    found: dict[str, RegistrySettings] = {}
    for registry, table in raw.items():
        where = f'{fleet}.registries."{registry}"'
        if not is_registry(registry):
            raise ConfigError(
                f"{path}: [{where}] does not name a registry. Write the registry as image "
                "references name it, host[:port] in quotes, the host a name with a dot, "
                f"localhost or an IP address: {example}."
            )
        if not isinstance(table, dict):
            raise ConfigError(
                f"{path}: {where} must be a table ([{where}] with ca_file, username and "
                "password_file, each optional)."
            )
        check_keys(table, _REGISTRY_KEYS, where, path)
        ca_file = _absolute_file(table, "ca_file", where, path)
        password_file = _absolute_file(table, "password_file", where, path)
        username = table.get("username")
        if username is not None and (
            type(username) is not str
            or not username
            or ":" in username
            or not username.isprintable()
        ):
            raise ConfigError(
                f"{path}: [{where}] username = {username!r} must be a non-empty string without "
                "':' or control characters, the account the coordinator pulls manifests as."
            )
        if (username is None) != (password_file is None):
            have, lack = (
                ("username", "password_file") if username else ("password_file", "username")
            )
            raise ConfigError(
                f"{path}: [{where}] has {have} but no {lack}. Set both (the password itself "
                "stays in the file password_file names), or neither for anonymous pulls."
            )
        timeout = table.get("timeout_s", DEFAULT_REGISTRY_TIMEOUT_S)
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not (0 < timeout <= 60)
        ):
            raise ConfigError(
                f"{path}: [{where}] timeout_s = {timeout!r} must be a number of seconds above 0 "
                "and at most 60: how long a Preview waits for this registry."
            )
        found[registry] = RegistrySettings(
            registry, ca_file, username, password_file, float(timeout)
        )
    return found


def _absolute_file(table: Mapping[str, Any], key: str, where: str, path: Path) -> Path | None:
    value = table.get(key)
    if value is None:
        return None
    if type(value) is not str or not value.startswith("/") or "\0" in value:
        raise ConfigError(
            f"{path}: [{where}] {key} = {value!r} must be an absolute file path in quotes, "
            f'e.g. {key} = "/etc/tuneplane/registry-{key.removesuffix("_file")}". Fix the value.'
        )
    return Path(value)
