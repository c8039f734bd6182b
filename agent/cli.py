"""``tuneplane-node``: enroll, run, status, doctor, journal (the on-call's offline reader), gpu,
images.

Rules: every failure is a typed error turned into one sentence on stderr and exit status 1;
``journal``, ``status`` and ``doctor`` open the journal read-only and never need the daemon or
the coordinator. ``gpu clear`` is the one operator write: one journal transaction, safe while
the daemon runs (SQLite serialises writers), which the daemon reads at its next refresh.

This module is the group and its ``--config``; each command is its own module (``enroll_cli``,
``run_cli``, ``status_cli``, ``doctor_cli``, ``gpu_cli``, ``journal_cli``), and what several
share is in ``cli_support`` (errors, ``--state-dir``), ``cli_settings`` (node.toml) and
``cli_gpu_source`` (the GPU source options).
"""

from __future__ import annotations

from pathlib import Path

import click

from . import config as node_config
from .cli_lazy import LazyGroup
from .cli_settings import NodeSettings

# Each command's module loads when that command runs (agent/cli_lazy.py).
COMMANDS = {
    "enroll": "tuneplane.agent.enroll_cli:enroll_command",
    "run": "tuneplane.agent.run_cli:run_command",
    "status": "tuneplane.agent.status_cli:status_command",
    "doctor": "tuneplane.agent.doctor_cli:doctor_command",
    "gpu": "tuneplane.agent.gpu_cli:gpu_group",
    # The runtime image cache (agent/images_cli.py).
    "images": "tuneplane.agent.images_cli:images_group",
    # The on-call's offline reader (agent/journal_cli.py).
    "journal": "tuneplane.agent.journal_cli:journal_group",
}


@click.group(cls=LazyGroup, lazy=COMMANDS)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="TUNEPLANE_NODE_CONFIG",
    default=None,
    help=f"Settings file whose keys give option defaults (default: {node_config.DEFAULT_PATH} "
    "when it exists). Flags on the command line win.",
)
@click.pass_context
def main(ctx: click.Context, config_path: Path | None) -> None:
    """The TunePlane agent on a GPU machine."""
    if config_path is None and node_config.DEFAULT_PATH.exists():
        config_path = node_config.DEFAULT_PATH
    if config_path is not None:
        try:
            settings = node_config.load(config_path)
        except node_config.NodeConfigError as exc:
            raise click.ClickException(str(exc)) from None
        ctx.default_map = node_config.default_map(settings)
    ctx.obj = NodeSettings(settings if config_path is not None else None, config_path)


if __name__ == "__main__":
    main()
