"""``tuneplane-coordinator token`` and ``fleet``: join tokens that let a Node enroll, and the
Fleets Nodes enroll into (kind node) or that reach an existing Slurm cluster (kind slurm).

Rules: a join token is printed once and stored only hashed; a Fleet's name, and a slurm Fleet's
settings and its slurmrestd's answer, are checked here, before the store is opened.
"""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import attrs
import click

from ..auth import JOIN_PREFIX, hash_credential, new_credential
from ..clock import now_ms
from ..config import load_config
from ..executors.slurm import (
    SlurmError,
    SlurmNode,
    SlurmSettingsError,
    check_settings,
    parse_series,
    probe_settings,
    series_words,
)
from ..store.core import NotFound, Store
from ..store.fleet_views import fleet_views
from ..values.fleet import Fleet, SlurmSettings
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
    type=click.Choice(["node", "slurm"]),
    help="Fleet kind: node (TunePlane Nodes enroll into it) or slurm (an existing Slurm "
    "cluster, reached through slurmrestd).",
)
@click.option(
    "--slurmrestd",
    default=None,
    metavar="URL",
    help="kind slurm: slurmrestd's URL, http://HOST:PORT.",
)
@click.option(
    "--token-file",
    default=None,
    metavar="PATH",
    help="kind slurm: a file holding a JWT from `scontrol token`, read at each use.",
)
@click.option(
    "--partition", default=None, metavar="P", help="kind slurm: the partition its Jobs run in."
)
@click.option(
    "--shared-dir",
    default=None,
    metavar="PATH",
    help="kind slurm: a folder the coordinator and every Slurm node see at the same path; "
    "each attempt's capsule, member folders, exit records and logs go there.",
)
@click.option(
    "--python",
    default=None,
    metavar="PYTHON",
    help="kind slurm: the interpreter, with TunePlane installed, that runs the Slurm step on "
    "the nodes (default python3).",
)
@click.option(
    "--spool-dir",
    default=None,
    metavar="PATH",
    help="kind slurm: a folder on each Slurm node's own storage for the members' collector "
    "spools (default: the node's temporary folder).",
)
@click.option(
    "--image-root",
    default=None,
    metavar="PATH",
    help="kind slurm: a folder on each Slurm node's own storage where the step caches runtime "
    "images; without it, Jobs with an image runtime are refused at Preview.",
)
@click.option(
    "--registries-file",
    default=None,
    metavar="PATH",
    help='kind slurm: a TOML file on every Slurm node with node.toml\'s [registries."host:port"] '
    "tables (ca_file, username, password_file) saying how the nodes reach image registries "
    "(default: the system's CAs, no credentials).",
)
@click.option(
    "--series",
    "series",
    multiple=True,
    metavar="SERIES=HOW",
    help="kind slurm, repeatable: how Slurm is asked for a Series, SERIES=gres:gpu:TYPE (its "
    "GPUs are the gpu GRES of that type) or SERIES=constraint:FEATURE (its nodes have that "
    "feature); once each per Series. With none, every Series asks for GPUs of any type; with "
    "some, a Preview of any other Series is refused.",
)
def fleet_create(
    name: str,
    state_dir: Path,
    kind: str,
    slurmrestd: str | None,
    token_file: str | None,
    partition: str | None,
    shared_dir: str | None,
    python: str | None,
    spool_dir: str | None,
    image_root: str | None,
    registries_file: str | None,
    series: tuple[str, ...],
) -> None:
    """Create a Fleet called NAME.

    A Fleet of kind slurm is checked before it is stored: slurmrestd must answer in an API
    version this coordinator speaks, accept the token, and have the partition."""
    if not NAME_PATTERN.match(name):
        raise click.BadParameter(
            f"{name!r} is not a Fleet name: use 1-63 lowercase letters, digits, '.', '_' or '-'.",
            param_hint="NAME",
        )
    given = {"--slurmrestd": slurmrestd, "--token-file": token_file, "--partition": partition}
    settings: SlurmSettings | None = None
    nodes: list[SlurmNode] = []
    if kind == "node":
        optional = {"--shared-dir": shared_dir, "--python": python, "--spool-dir": spool_dir,
                    "--image-root": image_root, "--registries-file": registries_file,
                    "--series": series or None}  # fmt: skip
        extra = [flag for flag, value in {**given, **optional}.items() if value is not None]
        if extra:
            raise click.UsageError(
                f"{', '.join(extra)} {'describes' if len(extra) == 1 else 'describe'} a Fleet "
                "of kind slurm; add --kind slurm, or drop them for a Fleet of Nodes."
            )
    else:
        absent = [flag for flag, value in given.items() if value is None]
        if absent:
            raise click.UsageError(
                f"A Fleet of kind slurm needs {', '.join(absent)}: where slurmrestd listens, "
                "the file holding a token from `scontrol token`, and the partition to run in."
            )
        assert slurmrestd is not None and token_file is not None and partition is not None
        try:
            settings = check_settings(
                slurmrestd, token_file, partition, shared_dir or "", python or "python3",
                spool_dir or "", image_root or "", registries_file or "",
            )  # fmt: skip
            settings = attrs.evolve(settings, series=parse_series(series))
        except (SlurmSettingsError, SlurmError) as exc:
            raise click.ClickException(str(exc)) from None
        nodes = _probe(settings)

    async def work(store: Store) -> None:
        await store.create_fleet(name, kind, now_ms(), slurm=settings)

    run(with_store, state_dir, work)
    if settings is None:
        click.echo(f"Created Fleet {name} (kind {kind}).")
        return
    gpus = sum(n.gpus for n in nodes)
    click.echo(
        f"Created Fleet {name} (kind slurm): partition {settings.partition} on "
        f"{settings.slurmrestd}, {len(nodes)} node{'s' * (len(nodes) != 1)}, {gpus} GPU"
        f"{'s' * (gpus != 1)}."
    )
    for mapped in settings.series:
        click.echo(f"Series {mapped.series}: {series_words(mapped)}.")
    if settings.image_root:
        reached = settings.registries_file or "the system's CAs, no credentials"
        click.echo(f"Images: cached in {settings.image_root} on each node; registries: {reached}.")


def _probe(settings: SlurmSettings) -> list[SlurmNode]:
    """The partition's nodes, or the command's failure saying why the Fleet was not created."""
    try:
        return anyio.run(probe_settings, settings, backend="asyncio")
    except (SlurmSettingsError, SlurmError) as exc:
        raise click.ClickException(f"{exc} The Fleet was not created.") from None


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
