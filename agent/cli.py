"""``tuneplane-node``: enroll, run, status, doctor, journal (the on-call's offline reader), gpu.

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
from .cli_settings import NodeSettings
from .doctor_cli import doctor_command
from .enroll_cli import enroll_command
from .gpu_cli import gpu_group
from .journal_cli import journal_group
from .run_cli import run_command
from .status_cli import status_command


@click.group()
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


main.add_command(enroll_command)
main.add_command(run_command)
main.add_command(status_command)
main.add_command(doctor_command)
main.add_command(gpu_group)
# The on-call's offline reader is its own module (agent/journal_cli.py), on this same group.
main.add_command(journal_group)

if __name__ == "__main__":
    main()
