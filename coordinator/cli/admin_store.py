"""``tuneplane-coordinator decisions`` and ``migrate-store``: read the decision log, and move the
stores from SQLite to PostgreSQL.

Rules: ``decisions`` opens the store read-only, so it is safe while ``serve`` runs;
``migrate-store`` wants ``serve`` stopped, and leaves the SQLite files as a frozen copy.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import click

from ..clock import now_ms
from ..config import CONFIG_NAME, store_setting
from ..server.state_dir import coordinator_where
from ..store.decision_log import format_row, parse_since, read_decisions
from ..store_location import StoreUrlError, parse_store_url
from .admin_common import run, run_sync, state_dir_option


@click.command(name="decisions")
@state_dir_option
@click.option("--run", "run_id", default="", help="Only decisions about this run id.")
@click.option(
    "--since",
    default="",
    help="Only decisions at or after this time: 15m, 2h, 7d back, an ISO time, or epoch ms.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per decision.")
def decisions(state_dir: Path, run_id: str, since: str, as_json: bool) -> None:
    """Print the append-only decision log (admission, reservation, commit/abort, state changes,
    Node scheduling). Opens the store read-only, so it is safe while serve runs."""
    since_ms = run_sync(parse_since, since, now_ms()) if since else 0
    where = coordinator_where(state_dir, run_sync(store_setting, state_dir))
    rows = run_sync(read_decisions, where, run_id, since_ms)
    for row in rows:
        if as_json:
            click.echo(json.dumps(attrs.asdict(row), sort_keys=True, separators=(",", ":")))
        else:
            click.echo(format_row(row))


@click.command(name="migrate-store")
@state_dir_option
@click.option(
    "--to",
    "to_url",
    required=True,
    metavar="URL",
    help="The PostgreSQL database to copy the stores into (postgresql://USER@HOST:PORT/DATABASE; "
    "the password from PGPASSWORD or ~/.pgpass). Its stores must be empty.",
)
def migrate_store(state_dir: Path, to_url: str) -> None:
    """Copy this installation's SQLite stores into a PostgreSQL database, check every table on
    both sides, and record [store] url so the next `serve` uses it. Stop `serve` first; the
    SQLite files stay, as a frozen copy."""
    # Imported here: only this command loads the PostgreSQL driver.
    from ..server.migrate_store import migrate
    from ..store import migrate as store_migrate
    from ..store.digest import report_lines

    state_dir = state_dir.absolute()
    try:
        url = parse_store_url(to_url, "--to")
    except StoreUrlError as exc:
        raise click.BadParameter(str(exc), param_hint="--to") from None
    try:
        done = run(migrate, state_dir, url, click.echo)
    except store_migrate.Mismatched as exc:
        click.echo("The copy differs from its source:")
        click.echo("\n".join(report_lines(exc.target)))
        for found in exc.mismatches:
            click.echo(f"  {found.store} {found.table}: {found.sentence}")
        raise click.ClickException(str(exc)) from None
    except store_migrate.MigrateError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo("Every table holds the same rows, with the same digest, in SQLite and PostgreSQL:")
    click.echo("\n".join(report_lines(done.digests)))
    config = state_dir / CONFIG_NAME
    click.echo(f"Recorded [store] url = {url} in {config}: the next `serve` uses PostgreSQL.")
    files = ", ".join(name for _, name in store_migrate.STORES)
    click.echo(
        f"The SQLite files ({files}) stay in {state_dir} as a frozen copy: nothing writes them "
        "any more."
    )
    rows = sum(d.rows for d in done.digests)
    click.echo(
        f"Migrated {len(store_migrate.STORES)} stores ({len(done.digests)} tables, {rows} rows) "
        f"to {url}; verified."
    )
