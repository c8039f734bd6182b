"""``tuneplane-coordinator init``: make a state directory (dev CA, server certificate, admin
token, store, coordinator.toml) for ``serve`` (admin_serve) to serve from.

Rules: ``init`` checks ``--store`` before it touches anything; it loads none of the server.
"""

from __future__ import annotations

from pathlib import Path

import click

from ..server.state_dir import initialise
from .admin_common import run, state_dir_option, store_option


@click.command(name="init")
@state_dir_option
@click.option("--san", multiple=True, help="Extra name or IP address for the server certificate.")
@click.option(
    "--store",
    "store_url",
    default=None,
    metavar="URL",
    help="Keep the stores in this PostgreSQL database (postgresql://USER@HOST:PORT/DATABASE; "
    "the password from PGPASSWORD or ~/.pgpass) instead of SQLite files in the state "
    "directory; recorded as [store] url in coordinator.toml.",
)
def init(state_dir: Path, san: tuple[str, ...], store_url: str | None) -> None:
    """Create a state directory: dev CA, server certificate, admin token, store, config."""
    state_dir = state_dir.absolute()
    url = store_option(store_url)
    run(initialise, state_dir, san, url)
    click.echo(f"Initialised a coordinator in {state_dir}.")
    if url is not None:
        click.echo(f"  store:          {url} (PostgreSQL; [store] url in coordinator.toml)")
    click.echo(f"  CA certificate: {state_dir / 'tls' / 'ca.pem'}")
    click.echo(f"  admin token:    {state_dir / 'admin.token'} (0600)")
    click.echo(f"Start it with: tuneplane-coordinator serve --state-dir {state_dir}")
