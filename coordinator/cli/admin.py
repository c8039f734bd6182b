"""``tuneplane-coordinator``: the commands the people who run a coordinator use.

Rules: every failure is one sentence on stderr naming the file or option, what is wrong and how
to fix it, with exit status 1 (2 for a malformed command line, as click does). Commands that touch
the store open the store a running ``serve`` uses (the SQLite files of the state directory, or the
PostgreSQL database ``[store] url`` names), one writer at a time, so they work while it runs.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import anyio
import attrs
import click

from tuneplane.agent import daemon_log
from tuneplane.proto.contract.input_checks import InputRefused

from ..auth import (
    JOIN_PREFIX,
    USER_PREFIX,
    CredentialLife,
    hash_credential,
    new_credential,
)
from ..clock import now_ms
from ..config import (
    CONFIG_NAME,
    ConfigError,
    load_config,
    parse_duration,
    store_setting,
)
from ..gateways.collector_credentials import CollectorCredentials
from ..server import control_address
from ..server.serve import (
    DEFAULT_API_PORT,
    DEFAULT_CONTROL_PORT,
    DEFAULT_TELEMETRY_PORT,
    ServeError,
    ServeOptions,
    serve,
)
from ..server.state_dir import (
    ENDPOINTS,
    TP_CONTEXT,
    StateDirError,
    coordinator_where,
    initialise,
    require_initialised,
)
from ..server.tls import TlsError, TlsPaths
from ..store import fleet as store_fleet
from ..store import identity as store_identity
from ..store import lifecycle as store_lifecycle
from ..store.core import NotFound, Store, StoreError
from ..store.decision_log import (
    DecisionLogError,
    format_row,
    parse_since,
    read_decisions,
)
from ..store.location import (
    PostgresUrl,
    StoreUrlError,
    parse_store_url,
    store_where,
)
from ..store.metrics import DB_NAME as TELEMETRY_DB
from ..store.metrics import TelemetryStore
from ..values.fleet import Fleet
from ..values.users import User
from .api_client import ApiClient
from .api_errors import ApiError
from .connection import ConnectionConfigError, resolve_connection

T = TypeVar("T")
_FLEET_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
_USER_NAME = _FLEET_NAME
_ERRORS = (
    InputRefused,
    StateDirError,
    StoreError,
    ConfigError,
    TlsError,
    ServeError,
    DecisionLogError,
    ApiError,
    ConnectionConfigError,
    StoreUrlError,
)

state_dir_option = click.option(
    "--state-dir",
    required=True,
    type=click.Path(path_type=Path, file_okay=False),
    help="The coordinator's state directory.",
)


def _run(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    try:
        return anyio.run(fn, *args, backend="asyncio")
    except _ERRORS as exc:
        raise click.ClickException(str(exc)) from None


def _store_option(text: str | None) -> PostgresUrl | None:
    """``--store``: a PostgreSQL URL checked now, before anything is touched."""
    if text is None:
        return None
    try:
        return parse_store_url(text, "--store")
    except StoreUrlError as exc:
        raise click.BadParameter(str(exc), param_hint="--store") from None


def parse_ttl(text: str, option: str = "--ttl") -> int:
    """``30s``, ``15m``, ``1h``, ``7d`` -> seconds."""
    seconds = parse_duration(text)
    if seconds is None:
        raise click.BadParameter(
            f"{text!r} is not a duration. Write a whole number and a unit: 30s, 15m, 1h or 7d.",
            param_hint=option,
        )
    return seconds


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Log debug detail to stderr.")
def main(verbose: bool) -> None:
    """Run and administer a TunePlane coordinator."""
    daemon_log.configure(
        logging.DEBUG if verbose else logging.INFO,
        "tuneplane-coordinator",
        "%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("hpack").setLevel(logging.WARNING)


@main.command()
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
    url = _store_option(store_url)
    _run(initialise, state_dir, san, url)
    click.echo(f"Initialised a coordinator in {state_dir}.")
    if url is not None:
        click.echo(f"  store:          {url} (PostgreSQL; [store] url in coordinator.toml)")
    click.echo(f"  CA certificate: {state_dir / 'tls' / 'ca.pem'}")
    click.echo(f"  admin token:    {state_dir / 'admin.token'} (0600)")
    click.echo(f"Start it with: tuneplane-coordinator serve --state-dir {state_dir}")


@main.command(name="serve")
@state_dir_option
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on (0.0.0.0 or :: for every address; then set --advertise).",
)
@click.option(
    "--advertise",
    default="",
    help="Name or address other machines dial to reach every listener; it is what serve hands "
    "out (endpoints.json, tp-context.json, the telemetry address Nodes get). Overrides "
    "[addresses] host in coordinator.toml; default: the --host address.",
)
@click.option(
    "--api-port",
    default=DEFAULT_API_PORT,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="API port (0: pick a free one).",
)
@click.option(
    "--control-port",
    default=DEFAULT_CONTROL_PORT,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="Control gateway port, the address Nodes enroll with (0: pick a free one).",
)
@click.option(
    "--telemetry-port",
    default=DEFAULT_TELEMETRY_PORT,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="Telemetry gateway port (0: pick a free one).",
)
@click.option(
    "--heartbeat-interval",
    default=5.0,
    show_default=True,
    type=click.FloatRange(min=0.05),
    help="Seconds between a Node's heartbeats.",
)
@click.option(
    "--heartbeat-timeout",
    default=15.0,
    show_default=True,
    type=click.FloatRange(min=0.1),
    help="Seconds of silence after which a Node's control stream is closed.",
)
@click.option(
    "--prepare-timeout",
    default=120.0,
    show_default=True,
    type=click.FloatRange(min=0.1),
    help="Seconds every member has to be prepared before the launch is aborted.",
)
@click.option(
    "--store",
    "store_url",
    default=None,
    metavar="URL",
    help="Use this PostgreSQL database for this run, over [store] url in coordinator.toml.",
)
def serve_command(
    state_dir: Path,
    host: str,
    advertise: str,
    api_port: int,
    control_port: int,
    telemetry_port: int,
    heartbeat_interval: float,
    heartbeat_timeout: float,
    prepare_timeout: float,
    store_url: str | None,
) -> None:
    """Serve the API, control and telemetry listeners until SIGTERM or SIGINT."""
    url = _store_option(store_url)
    if heartbeat_timeout <= heartbeat_interval:
        raise click.BadParameter(
            f"--heartbeat-timeout ({heartbeat_timeout:g}) must be longer than "
            f"--heartbeat-interval ({heartbeat_interval:g}), or every Node looks dead.",
            param_hint="--heartbeat-timeout",
        )
    _run(
        serve,
        ServeOptions(
            state_dir=state_dir,
            host=host,
            advertise=advertise,
            api_port=api_port,
            control_port=control_port,
            telemetry_port=telemetry_port,
            heartbeat_interval_s=heartbeat_interval,
            heartbeat_timeout_s=heartbeat_timeout,
            prepare_timeout_s=prepare_timeout,
            store_url=url,
        ),
    )


async def _with_store(state_dir: Path, work: Callable[[Store], Awaitable[T]]) -> T:
    url = store_setting(state_dir)
    require_initialised(state_dir, url)
    store = await Store.open(coordinator_where(state_dir, url))
    try:
        return await work(store)
    finally:
        await store.close()


@main.group()
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

    used_fleet = _run(_with_store, state_dir, work)
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


@main.group()
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
    if not _FLEET_NAME.match(name):
        raise click.BadParameter(
            f"{name!r} is not a Fleet name: use 1-63 lowercase letters, digits, '.', '_' or '-'.",
            param_hint="NAME",
        )

    async def work(store: Store) -> None:
        await store.create_fleet(name, kind, now_ms())

    _run(_with_store, state_dir, work)
    click.echo(f"Created Fleet {name} (kind {kind}).")


@fleet.command(name="ls")
@state_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def fleet_ls(state_dir: Path, as_json: bool) -> None:
    """List Fleets with their Nodes and GPUs per Series (also `tp fleet ls`)."""
    config = _run_sync(load_config, state_dir)

    async def work(store: Store) -> list[Fleet]:
        return await store_fleet.fleet_views(store, config.quotas)

    fleets = _run(_with_store, state_dir, work)
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


def _run_sync(fn: Callable[..., T], *args: Any) -> T:
    try:
        return fn(*args)
    except _ERRORS as exc:
        raise click.ClickException(str(exc)) from None


@main.group()
def user() -> None:
    """Users: who may call the API. Each has a token; Jobs record the user who committed them."""


_expires_in_option = click.option(
    "--expires-in",
    default=None,
    help="How long the token works: 30m, 12h, 90d, or never (default: coordinator.toml's "
    "[credentials] user_token_lifetime, 90d unless set).",
)


@user.command(name="create")
@click.argument("name")
@state_dir_option
@click.option("--admin", "is_admin", is_flag=True, help="May cordon, uncordon and drain Nodes.")
@_expires_in_option
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of the token.")
def user_create(
    name: str, state_dir: Path, is_admin: bool, expires_in: str | None, as_json: bool
) -> None:
    """Create the user NAME and print their token (shown once, stored only hashed)."""
    if not _USER_NAME.match(name):
        raise click.BadParameter(
            f"{name!r} is not a user name: use 1-63 lowercase letters, digits, '.', '_' or '-'.",
            param_hint="NAME",
        )
    secret = new_credential(USER_PREFIX)
    role = "admin" if is_admin else "researcher"
    now = now_ms()
    expires = _token_expiry(state_dir, expires_in, now)

    async def work(store: Store) -> None:
        await store_fleet.create_user(store, name, hash_credential(secret), role, now, expires)

    _run(_with_store, state_dir, work)
    _print_token(name, role, secret, expires, as_json)


def _token_expiry(state_dir: Path, expires_in: str | None, now: int) -> int | None:
    """When a new user token expires: ``--expires-in``, else coordinator.toml's lifetime."""
    if expires_in == "never":
        return None
    if expires_in is None:
        seconds = _run_sync(load_config, state_dir).user_token_lifetime_s
    else:
        seconds = parse_ttl(expires_in, "--expires-in")
    return now + seconds * 1000


def _print_token(name: str, role: str, secret: str, expires: int | None, as_json: bool) -> None:
    if as_json:
        click.echo(
            json.dumps(
                {"user": name, "role": role, "token": secret, "expires_at_ms": expires},
                sort_keys=True,
            )
        )
    else:
        click.echo(secret)


@user.command(name="token")
@click.argument("name")
@state_dir_option
@_expires_in_option
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of the token.")
def user_token(name: str, state_dir: Path, expires_in: str | None, as_json: bool) -> None:
    """Give the user NAME a new token (printed once); their old token stops working at once."""
    secret = new_credential(USER_PREFIX)
    now = now_ms()
    expires = _token_expiry(state_dir, expires_in, now)

    async def work(store: Store) -> str:
        await store_identity.issue_user_token(
            store, name, hash_credential(secret), expires, "admin CLI", now
        )
        return next(u.role for u in await store_fleet.users(store) if u.name == name)

    role = _run(_with_store, state_dir, work)
    _print_token(name, role, secret, expires, as_json)


@user.command(name="revoke")
@click.argument("name")
@state_dir_option
def user_revoke(name: str, state_dir: Path) -> None:
    """Revoke the user NAME's token: every call with it is refused from the next one on."""

    async def work(store: Store) -> bool:
        return await store_identity.revoke_user(store, name, "admin CLI", now_ms())

    changed = _run(_with_store, state_dir, work)
    if changed:
        click.echo(
            f"Revoked the token of user {name}. Give them a new one with "
            f"`tuneplane-coordinator user token {name}`."
        )
    else:
        click.echo(f"The token of user {name} was already revoked; nothing changed.")


@user.command(name="ls")
@state_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def user_ls(state_dir: Path, as_json: bool) -> None:
    """List users, their roles and their tokens' expiry or revocation (never the tokens)."""

    async def work(store: Store) -> tuple[list[User], dict[str, CredentialLife]]:
        return await store_fleet.users(store), await store_identity.user_token_lives(store)

    found, lives = _run(_with_store, state_dir, work)
    if as_json:
        rows = [
            {
                **attrs.asdict(u),
                "expires_at_ms": lives[u.name].expires_at_ms,
                "revoked_at_ms": lives[u.name].revoked_at_ms,
            }
            for u in found
        ]
        click.echo(json.dumps(rows, indent=2, sort_keys=True))
        return
    now = now_ms()
    for u in found:
        life = lives[u.name]
        spent = life.spent(now)
        if spent is not None:
            token = f"{spent[0].upper()} {_utc(spent[1])}"
        elif life.expires_at_ms is None:
            token = "never expires"
        else:
            token = f"expires {_utc(life.expires_at_ms)}"
        click.echo(f"{u.name}  role={u.role}  token {token}")


def _utc(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M UTC")


@main.group()
def node() -> None:
    """Nodes: revoke a Node's control credential, or declare a Node that never comes back lost."""


@node.command(name="revoke")
@click.argument("node_id", metavar="NODE")
@state_dir_option
@click.option("--reason", default="", help="Why; recorded in the decision log.")
def node_revoke(node_id: str, state_dir: Path, reason: str) -> None:
    """Revoke NODE (its id, name or FLEET/NAME): end its live control stream now and refuse its
    credential from then on.

    With the coordinator serving, this goes through its API (admin token), which records the
    decision and ends the stream at once; when it is not serving, the store is written directly.
    """
    state_dir = state_dir.absolute()
    _run_sync(require_initialised, state_dir)
    live = _serving_pid(state_dir)
    if live:
        endpoint = _run_sync(resolve_connection, state_dir / TP_CONTEXT, None, None, None)

        async def call() -> str:
            async with ApiClient(endpoint) as api:
                return (await api.revoke_node(node_id, reason or "revoked by the operator")).id

        node_id = _run(call)
        click.echo(
            f"Revoked Node {node_id}: its control stream is ended and its credential refused. "
            "To use the machine again, make a join token for it (`tuneplane-coordinator token "
            f"create --node {node_id}`) and run `tuneplane-node enroll --re-enroll` there."
        )
        return

    async def work(store: Store) -> tuple[str, bool]:
        found = await store_fleet.resolve_node(store, node_id)
        changed = await store_identity.revoke_node(
            store, found, "admin CLI", reason or "revoked by the operator", now_ms()
        )
        return found, changed

    node_id, changed = _run(_with_store, state_dir, work)
    click.echo(
        (f"Revoked Node {node_id}" if changed else f"Node {node_id} was already revoked")
        + " (the coordinator is not serving, so no live stream needed ending). To use the "
        "machine again, make a join token for it (`tuneplane-coordinator token create --node "
        f"{node_id}`) and run `tuneplane-node enroll --re-enroll` there."
    )


@node.command(name="lost")
@click.argument("node_id", metavar="NODE")
@state_dir_option
@click.option(
    "--reason",
    required=True,
    help="How you know the machine is off (recorded in the decision log).",
)
def node_lost(node_id: str, state_dir: Path, reason: str) -> None:
    """Declare NODE (its id, name or FLEET/NAME) lost: it never comes back, so its members end
    `lost`.

    Make sure the machine is off first (power it off through its BMC or PDU): a workload still
    running there would write outputs nobody waits for. Its live members end (`lost`, or their
    launch aborted before Commit), their Jobs end or their pending cancels complete, their GPUs go
    back, the members on other Nodes that worked with them are stopped, and the Node is cordoned,
    all as decisions. A connected Node is refused. Repeating it changes nothing. If the Node ever
    reconnects, it is told to stop those members.
    """
    state_dir = state_dir.absolute()
    _run_sync(require_initialised, state_dir)
    if not reason.strip():
        raise click.BadParameter(
            "is empty. Say how you know the machine is off; it goes into the decision log.",
            param_hint="--reason",
        )
    if _serving_pid(state_dir):
        endpoint = _run_sync(resolve_connection, state_dir / TP_CONTEXT, None, None, None)

        async def call() -> tuple[str, list[str], list[tuple[str, str, str]], str]:
            async with ApiClient(endpoint) as api:
                outcome = await api.declare_node_lost(node_id, reason)
            jobs = [(j.run_id, j.state, j.state_reason) for j in outcome.jobs]
            return outcome.node.id, [k.text for k in outcome.lost], jobs, outcome.node.scheduling

        node_id, lost, jobs, scheduling = _run(call)
    else:

        async def work(store: Store) -> tuple[str, list[str], list[tuple[str, str, str]], str]:
            found = await store_fleet.resolve_node(store, node_id)
            loss = await store_lifecycle.declare_node_lost(
                store, found, "admin CLI", reason, now_ms()
            )
            where = store_where(state_dir, store_setting(state_dir), TELEMETRY_DB)
            telemetry = await TelemetryStore.open(where)
            try:
                # The lost members' collector credentials drain and expire, as for any end.
                for member in loss.lost:
                    await CollectorCredentials(telemetry).member_ended(member, now_ms())
            finally:
                await telemetry.close()
            jobs = []
            for run_id in loss.runs:
                job = await store.get_job(run_id)
                jobs.append((run_id, job.state, job.state_reason))
            view = await store_fleet.node_view(store, found)
            lost = [k.text for k in loss.lost]
            return found, lost, jobs, view.scheduling

        node_id, lost, jobs, scheduling = _run(_with_store, state_dir, work)
    if not lost:
        click.echo(f"Node {node_id} holds no live member: no Job changed, and it is {scheduling}.")
        return
    click.echo(f"Declared Node {node_id} lost; it is {scheduling}. Members ended:")
    for member in lost:
        click.echo(f"  {member}")
    for run_id, state, why in jobs:
        click.echo(f"Job {run_id} is {state}: {why}")
    click.echo(
        "If the machine comes back, its agent is told to stop these members. Uncordon it with "
        f"`tp node uncordon {node_id}` once a person has checked it."
    )


def _serving_pid(state_dir: Path) -> int:
    """The pid of a ``serve`` running on this state directory (its endpoints.json), or 0."""
    try:
        pid = int(json.loads((state_dir / ENDPOINTS).read_text(encoding="utf-8"))["pid"])
        os.kill(pid, 0)
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    return pid


@main.command()
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
    since_ms = _run_sync(parse_since, since, now_ms()) if since else 0
    where = coordinator_where(state_dir, _run_sync(store_setting, state_dir))
    rows = _run_sync(read_decisions, where, run_id, since_ms)
    for row in rows:
        if as_json:
            click.echo(json.dumps(attrs.asdict(row), sort_keys=True, separators=(",", ":")))
        else:
            click.echo(format_row(row))


@main.command(name="migrate-store")
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
    from ..store import migrate as store_migrate
    from ..store.digest import report_lines

    state_dir = state_dir.absolute()
    try:
        url = parse_store_url(to_url, "--to")
    except StoreUrlError as exc:
        raise click.BadParameter(str(exc), param_hint="--to") from None
    try:
        done = _run(store_migrate.migrate, state_dir, url, click.echo)
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


@main.command(name="control-address")
@click.argument("address", required=False, default=None)
@state_dir_option
@click.option("--clear", is_flag=True, help="Stop telling Nodes an address.")
def control_address_command(address: str | None, state_dir: Path, clear: bool) -> None:
    """Tell every Node the control ADDRESS (HOST:PORT) to dial from now on; with no ADDRESS,
    show the address Nodes are told and the one each Node last dialed.

    Connected Nodes are told at once, the others at their next connect; each keeps the address
    it dialed as a fallback. Set it while the old address still serves, wait until every Node
    shows the new one under DIALED, then move the coordinator (docs/operator.md, "Moving the
    coordinator"). Its host must be a name the server certificate covers.
    """
    state_dir = state_dir.absolute()
    _run_sync(require_initialised, state_dir)
    if address is not None and clear:
        raise click.UsageError("Give an ADDRESS or --clear, not both.")
    if address is None and not clear:
        _show_control_address(state_dir)
        return
    wanted = "" if clear else address or ""
    if _serving_pid(state_dir):
        endpoint = _run_sync(resolve_connection, state_dir / TP_CONTEXT, None, None, None)

        async def call() -> tuple[str, int]:
            async with ApiClient(endpoint) as api:
                return await api.set_control_address(wanted)

        stored, told = _run(call)
        if not stored:
            click.echo("Nodes are no longer told an address; each keeps dialing its own.")
            return
        click.echo(
            f"Nodes are told to dial {stored}: {told} connected Node(s) told now, the others at "
            "their next connect. Check who follows with `tuneplane-coordinator control-address`."
        )
        return
    checked = _run_sync(control_address.check, wanted, TlsPaths.under(state_dir).server_cert)

    async def work(store: Store) -> bool:
        return await control_address.record(store, checked, "admin CLI", now_ms())

    _run(_with_store, state_dir, work)
    if not checked:
        click.echo("Nodes are no longer told an address; each keeps dialing its own.")
        return
    click.echo(
        f"Nodes will be told to dial {checked} when they next connect (the coordinator is not "
        "serving now)."
    )


def _show_control_address(state_dir: Path) -> None:
    async def work(store: Store) -> tuple[str, list[tuple[str, str, str, bool]]]:
        nodes = await store_fleet.node_views(store)
        rows = [(n.id, n.name, n.dialed_address, n.connected) for n in nodes]
        return await control_address.current(store), rows

    address, rows = _run(_with_store, state_dir, work)
    click.echo(f"Nodes are told to dial: {address or '(nothing set: each dials its own)'}")
    if not rows:
        return
    width = max(len(r[0]) for r in rows)
    named = max(len(r[1]) for r in rows)
    click.echo(f"{'NODE':<{width}}  {'NAME':<{named}}  CONNECTED  DIALED")
    for node_id, name, dialed, connected in rows:
        mark = "yes" if connected else "no"
        click.echo(f"{node_id:<{width}}  {name:<{named}}  {mark:<9}  {dialed or '-'}")


if __name__ == "__main__":
    main()
