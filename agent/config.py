"""``/etc/tuneplane/node.toml``: the settings a sysadmin writes once per machine.

Rules: the file only supplies defaults for command-line options (a flag always wins); an unknown
key or a value of the wrong type is an error naming the file, the key and the fix, so a typo
never silently falls back to a built-in default.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DEFAULT_PATH = Path("/etc/tuneplane/node.toml")

# key in node.toml -> (type, the commands whose option of the same name it sets)
_KEYS: Mapping[str, tuple[type, tuple[str, ...]]] = {
    "state_dir": (str, ("enroll", "run", "status", "doctor", "journal")),
    "out_root": (str, ("run",)),
    "simulate_gpus": (str, ("enroll", "run")),
    "log_level": (str, ("run",)),
}
_JOURNAL_COMMANDS = ("members", "show", "events", "reservations", "export")


class NodeConfigError(ValueError):
    """node.toml cannot be used; the message says which key and how to fix it."""


def load(path: Path) -> dict[str, Any]:
    """Read and check node.toml; returns only known keys with values of the right type."""
    try:
        with path.open("rb") as fh:
            raw = tomllib.load(fh)
    except OSError as exc:
        raise NodeConfigError(f"Cannot read {path}: {exc.strerror}. Check the path.") from None
    except tomllib.TOMLDecodeError as exc:
        raise NodeConfigError(f"{path} is not valid TOML ({exc}). Fix the syntax.") from None
    for key, value in raw.items():
        if key not in _KEYS:
            known = ", ".join(sorted(_KEYS))
            raise NodeConfigError(
                f"{path}: unknown key '{key}'. Known keys are {known}; remove or rename it."
            )
        kind = _KEYS[key][0]
        if not isinstance(value, kind):
            raise NodeConfigError(
                f"{path}: '{key}' must be a {kind.__name__}, not {type(value).__name__} "
                f'({value!r}). Quote it, e.g. {key} = "...".'
            )
    return dict(raw)


def default_map(settings: Mapping[str, Any]) -> dict[str, Any]:
    """click's ``default_map`` for the ``tuneplane-node`` group built from node.toml settings."""
    defaults: dict[str, Any] = {}
    for key, value in settings.items():
        for command in _KEYS[key][1]:
            if command == "journal":
                group = defaults.setdefault("journal", {})
                for sub in _JOURNAL_COMMANDS:
                    group.setdefault(sub, {})[key] = value
            else:
                defaults.setdefault(command, {})[key] = value
    return defaults
