"""A click group that imports a command's module only when that command runs.

``tuneplane-node`` and ``tuneplane-coordinator`` name their commands as ``"module:attribute"``,
so ``tuneplane-node journal members`` pays for the journal reader alone and not for the daemon,
the gRPC stack and the GPU probes it never uses: an on-call engineer's command, or a script
polling one, starts in a fraction of the time. ``--help`` lists every command, and so imports
them all. (``tp`` imports its commands at start: each of them needs the gRPC client anyway.)
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import click


class LazyGroup(click.Group):
    """A group whose ``lazy`` commands (name → ``"module:attribute"``) load on first use."""

    def __init__(self, *args: Any, lazy: Mapping[str, str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lazy = dict(lazy)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self._lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        where = self._lazy.get(cmd_name)
        if where is None:
            return super().get_command(ctx, cmd_name)
        module, _, attribute = where.partition(":")
        command = getattr(importlib.import_module(module), attribute)
        if not isinstance(command, click.Command) or command.name != cmd_name:
            raise TypeError(f"{where} is not the click command {cmd_name!r}")
        return command
