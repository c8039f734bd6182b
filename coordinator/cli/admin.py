"""``tuneplane-coordinator``: the commands the people who run a coordinator use.

This module is the front door: the click group and its entry point. The commands live beside it,
one module per concern: ``admin_init`` (init), ``admin_serve`` (serve), ``admin_fleet`` (token,
fleet), ``admin_users`` (user), ``admin_nodes`` (node, control-address) and ``admin_store``
(decisions, migrate-store); what they share is in ``admin_common``.

Rules: every failure is one sentence on stderr naming the file or option, what is wrong and how
to fix it, with exit status 1 (2 for a malformed command line, as click does). Commands that touch
the store open the store a running ``serve`` uses (the SQLite files of the state directory, or the
PostgreSQL database ``[store] url`` names), one writer at a time, so they work while it runs.

Unlike the rest of the package, this module imports its siblings absolutely: ``python -m
tuneplane.coordinator.cli.admin serve`` makes it the main module, and each worker process of
:func:`~tuneplane.coordinator.offload.in_process` runs the main module again by its path, as
multiprocessing does, where a relative import has no package to be relative to.
"""

from __future__ import annotations

import logging

import click

from tuneplane.agent import daemon_log
from tuneplane.agent.cli_lazy import LazyGroup

_HERE = "tuneplane.coordinator.cli"
# Each command's module loads when that command runs (agent/cli_lazy.py): ``token create`` or
# ``decisions`` never loads the server.
COMMANDS = {
    "init": f"{_HERE}.admin_init:init",
    "serve": f"{_HERE}.admin_serve:serve_command",
    "token": f"{_HERE}.admin_fleet:token",
    "fleet": f"{_HERE}.admin_fleet:fleet",
    "user": f"{_HERE}.admin_users:user",
    "node": f"{_HERE}.admin_nodes:node",
    "decisions": f"{_HERE}.admin_store:decisions",
    "migrate-store": f"{_HERE}.admin_store:migrate_store",
    "control-address": f"{_HERE}.admin_nodes:control_address_command",
    "status": f"{_HERE}.admin_status:status",
}


@click.group(cls=LazyGroup, lazy=COMMANDS)
@click.option("-v", "--verbose", is_flag=True, help="Log debug detail to stderr.")
def main(verbose: bool) -> None:
    """Run and administer a TunePlane coordinator."""
    daemon_log.configure(
        logging.DEBUG if verbose else logging.INFO,
        "tuneplane-coordinator",
        "%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("hpack").setLevel(logging.WARNING)


if __name__ == "__main__":
    main()
