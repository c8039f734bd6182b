"""node.toml as ``tuneplane-node`` read it, for the commands that take settings from it.

Rules: ``main`` (agent/cli.py) reads node.toml once and leaves it on the root context as
:class:`NodeSettings`; a command reads its part here (the safe default without a node.toml or
without the table), so every command reads the same file the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import click

from . import config as node_config
from . import workload_checks
from .config_registries import registries_settings
from .image_access import RegistryAccess
from .metrics_listener import MetricsListener


@attrs.frozen
class NodeSettings:
    """node.toml as ``main`` read it (``values`` is None without a file), for the commands."""

    values: dict[str, Any] | None
    path: Path | None


def metrics_listener() -> MetricsListener | None:
    """node.toml's [metrics] listener; None (off) without the table or without a node.toml."""
    found = click.get_current_context().find_root().obj
    if isinstance(found, NodeSettings) and found.values is not None:
        return node_config.metrics_settings(found.values, found.path)
    return None


def outputs_settings() -> tuple[node_config.OutputsSettings, Path | None]:
    """node.toml's [outputs] (the default listener without the table or without a node.toml)."""
    found = click.get_current_context().find_root().obj
    if isinstance(found, NodeSettings) and found.values is not None:
        return node_config.outputs_settings(found.values, found.path), found.path
    return node_config.OutputsSettings(), None


def images_settings() -> int | None:
    """node.toml's [images] max_size in bytes (None: no limit, or no node.toml)."""
    found = click.get_current_context().find_root().obj
    if isinstance(found, NodeSettings) and found.values is not None:
        return node_config.images_settings(found.values, found.path).max_bytes
    return None


def workload_policy() -> node_config.WorkloadPolicy:
    """The workload policy of node.toml (or the safe default) for this agent's user."""
    found = click.get_current_context().find_root().obj
    if isinstance(found, NodeSettings):
        return workload_checks.policy_from(found.values, found.path)
    return workload_checks.policy_from(None, None)


def registries() -> dict[str, RegistryAccess]:
    """node.toml's [registries."<host[:port]>"], their CA files and passwords read (by ``run``
    only: the secrets stay in the agent); none without the tables or without a node.toml."""
    found = click.get_current_context().find_root().obj
    if isinstance(found, NodeSettings) and found.values is not None:
        return registries_settings(found.values, found.path)
    return {}


def roots(state_dir: Path) -> tuple[Path, Path]:
    """The work and output roots node.toml sets (or their defaults beside the state dir)."""
    settings = click.get_current_context().find_root().obj
    known = (settings.values if isinstance(settings, NodeSettings) else None) or {}
    outputs = Path(known.get("out_root") or workload_checks.default_out_root(state_dir))
    works = Path(known.get("work_root") or workload_checks.default_work_root(state_dir))
    return works, outputs
