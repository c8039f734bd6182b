"""How this Node reaches one registry: a value node.toml makes (agent/config.py) and the puller
uses (agent/image_pull.py), kept apart from both so reading node.toml loads no HTTP client."""

from __future__ import annotations

from pathlib import Path

import attrs


@attrs.frozen
class RegistryAccess:
    """How this Node reaches one registry: the CA bundle that verifies it (``None``: the system's)
    and the credentials the Node holds for it (never the workload's)."""

    ca_file: Path | None = None
    username: str | None = None
    password: str | None = attrs.field(default=None, repr=False)
