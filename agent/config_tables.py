"""The checks every node.toml table shares: its keys and their types, refused with a sentence
naming the file, the key and the fix (:class:`NodeConfigError`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: Where node.toml is read from unless --config says otherwise.
DEFAULT_PATH = Path("/etc/tuneplane/node.toml")


class NodeConfigError(ValueError):
    """node.toml cannot be used; the message says which key and how to fix it."""


def _type_name(kind: type) -> str:
    return {str: "a string", int: "an integer", bool: "true or false", list: "a list",
            dict: "a table", float: "a number of seconds"}[kind]  # fmt: skip


def check_table(path: Path, where: str, raw: Mapping[str, Any], keys: Mapping[str, type]) -> None:
    for key, value in raw.items():
        if key not in keys:
            known = ", ".join(sorted(keys))
            raise NodeConfigError(
                f"{path}: unknown key '{where}.{key}'. Known keys of [{where}] are {known}; "
                "remove or rename it."
            )
        kind = keys[key]
        if type(value) is not kind:
            raise NodeConfigError(
                f"{path}: '{where}.{key}' must be {_type_name(kind)}, not "
                f"{type(value).__name__} ({value!r}). Fix its value."
            )
