"""``tuneplane-coordinator token`` and ``fleet``: join tokens that let a Node enroll, and the
Fleets Nodes enroll into.

Rules: a join token is printed once and stored only hashed; a Fleet's name is checked here,
before the store is opened.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import click

from ..auth import JOIN_PREFIX, hash_credential, new_credential
from ..clock import now_ms
from ..config import load_config
from ..store.core import NotFound, Store
from ..store.fleet_views import fleet_views
from ..values.fleet import Fleet
from .admin_common import (
    NAME_PATTERN,
    parse_ttl,
    run,
    run_sync,
    state_dir_option,
    with_store,
)


@click.group(name="token")
def token() -> None:
    """Join tokens that let a Node enroll into a Fleet."""


@token.command(name="create")
@state_dir_option
@click.option("--fleet", default="default", show_default=True, help="Fleet the Node joins.")
@click.option("--ttl", default="1h", show_default=True, help="How long the token is valid.")
@click.option(
    "--node",
    "for_node",
    default=None,
    help="Make a token that only re-enrolls this existing Node (`tuneplane-node enroll "
    "--re-enroll`), in its own Fleet; it enrolls nothing else.",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of the token.")
def token_create(
    state_dir: Path, fleet: str, ttl: str, for_node: str | None, as_json: bool
) -> None:
    """Print a one-time join token (stored hashed, usable once, until it expires)."""
    seconds = parse_ttl(ttl)
    secret = new_credential(JOIN_PREFIX)
    now = now_ms()
    expires = now + seconds * 1000

    async def work(store: Store) -> str:
        target = fleet
        if for_node is not None:
            node = await store.node(for_node)
            if node is None:
                raise NotFound(
                    f"there is no Node {for_node!r} to re-enroll. List the Nodes with "
                    "`tp node ls`; a new machine takes a token made without --node."
                )
            target = node.fleet
        await store.create_join_token(hash_credential(secret), target, now, expires, for_node)
        return target

    used_fleet = run(with_store, state_dir, work)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "token": secret,
                    "fleet": used_fleet,
                    "expires_at_ms": expires,
                    "for_node": for_node,
                }
            )
        )
    else:
        click.echo(secret)


@click.group(name="fleet")
def fleet() -> None:
    """Fleets: named execution targets that Nodes enroll into."""


@fleet.command(name="create")
@click.argument("name")
@state_dir_option
@click.option(
    "--kind",
    default="node",
    show_default=True,
    type=click.Choice(["node"]),
    help="Fleet kind (only node is supported by this backend).",
)
def fleet_create(name: str, state_dir: Path, kind: str) -> None:
    """Create a Fleet called NAME."""
    if not NAME_PATTERN.match(name):
        raise click.BadParameter(
            f"{name!r} is not a Fleet name: use 1-63 lowercase letters, digits, '.', '_' or '-'.",
            param_hint="NAME",
        )

    async def work(store: Store) -> None:
        await store.create_fleet(name, kind, now_ms())

    run(with_store, state_dir, work)
    click.echo(f"Created Fleet {name} (kind {kind}).")


@fleet.command(name="ls")
@state_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def fleet_ls(state_dir: Path, as_json: bool) -> None:
    """List Fleets with their Nodes and GPUs per Series (also `tp fleet ls`)."""
    config = run_sync(load_config, state_dir)

    async def work(store: Store) -> list[Fleet]:
        return await fleet_views(store, config.quotas)

    fleets = run(with_store, state_dir, work)
    if as_json:
        click.echo(json.dumps([attrs.asdict(f) for f in fleets], indent=2, sort_keys=True))
        return
    for f in fleets:
        gpus = ", ".join(
            f"{c.series} {c.free} free/{c.healthy} healthy"
            + (f" (quota {c.in_use}/{c.quota})" if c.quota else "")
            for c in f.capacity
        )
        click.echo(
            f"{f.name}  kind={f.kind}  nodes={f.nodes} connected={f.connected_nodes} "
            f"schedulable={f.schedulable_nodes}  jobs queued={f.queued_jobs} "
            f"active={f.active_jobs}  gpus: {gpus or 'none'}"
        )
