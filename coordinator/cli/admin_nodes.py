"""``tuneplane-coordinator node`` and ``control-address``: revoke a Node, declare a Node lost,
and tell Nodes the control address to dial.

Rules: with ``serve`` running on the state directory, each command goes through its API (admin
token), so the live control streams hear of each change at once; otherwise the command writes
the store directly.
"""

from __future__ import annotations

from pathlib import Path

import click

from .. import control_address
from ..clock import now_ms
from ..config import store_setting
from ..gateways.collector_credentials import CollectorCredentials
from ..server.state_dir import TP_CONTEXT, require_initialised
from ..server.tls import TlsPaths
from ..store import control_address as store_control_address
from ..store import identity as store_identity
from ..store.core import Store
from ..store.fleet_views import node_view, node_views, resolve_node
from ..store.lost_nodes import declare_node_lost
from ..store.telemetry import DB_NAME as TELEMETRY_DB
from ..store.telemetry import TelemetryStore
from ..store_location import store_where
from .admin_common import run, run_sync, serving_pid, state_dir_option, with_store
from .api_client import ApiClient
from .connection import resolve_connection


@click.group(name="node")
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
    run_sync(require_initialised, state_dir)
    live = serving_pid(state_dir)
    if live:
        endpoint = run_sync(resolve_connection, state_dir / TP_CONTEXT, None, None, None)

        async def call() -> str:
            async with ApiClient(endpoint) as api:
                return (await api.revoke_node(node_id, reason or "revoked by the operator")).id

        node_id = run(call)
        click.echo(
            f"Revoked Node {node_id}: its control stream is ended and its credential refused. "
            "To use the machine again, make a join token for it (`tuneplane-coordinator token "
            f"create --node {node_id}`) and run `tuneplane-node enroll --re-enroll` there."
        )
        return

    async def work(store: Store) -> tuple[str, bool]:
        found = await resolve_node(store, node_id)
        changed = await store_identity.revoke_node(
            store, found, "admin CLI", reason or "revoked by the operator", now_ms()
        )
        return found, changed

    node_id, changed = run(with_store, state_dir, work)
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
    run_sync(require_initialised, state_dir)
    if not reason.strip():
        raise click.BadParameter(
            "is empty. Say how you know the machine is off; it goes into the decision log.",
            param_hint="--reason",
        )
    if serving_pid(state_dir):
        endpoint = run_sync(resolve_connection, state_dir / TP_CONTEXT, None, None, None)

        async def call() -> tuple[str, list[str], list[tuple[str, str, str]], str]:
            async with ApiClient(endpoint) as api:
                outcome = await api.declare_node_lost(node_id, reason)
            jobs = [(j.run_id, j.state, j.state_reason) for j in outcome.jobs]
            return outcome.node.id, [k.text for k in outcome.lost], jobs, outcome.node.scheduling

        node_id, lost, jobs, scheduling = run(call)
    else:

        async def work(store: Store) -> tuple[str, list[str], list[tuple[str, str, str]], str]:
            found = await resolve_node(store, node_id)
            loss = await declare_node_lost(store, found, "admin CLI", reason, now_ms())
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
            view = await node_view(store, found)
            lost = [k.text for k in loss.lost]
            return found, lost, jobs, view.scheduling

        node_id, lost, jobs, scheduling = run(with_store, state_dir, work)
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


@click.command(name="control-address")
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
    run_sync(require_initialised, state_dir)
    if address is not None and clear:
        raise click.UsageError("Give an ADDRESS or --clear, not both.")
    if address is None and not clear:
        _show_control_address(state_dir)
        return
    wanted = "" if clear else address or ""
    if serving_pid(state_dir):
        endpoint = run_sync(resolve_connection, state_dir / TP_CONTEXT, None, None, None)

        async def call() -> tuple[str, int]:
            async with ApiClient(endpoint) as api:
                return await api.set_control_address(wanted)

        stored, told = run(call)
        if not stored:
            click.echo("Nodes are no longer told an address; each keeps dialing its own.")
            return
        click.echo(
            f"Nodes are told to dial {stored}: {told} connected Node(s) told now, the others at "
            "their next connect. Check who follows with `tuneplane-coordinator control-address`."
        )
        return
    checked = run_sync(control_address.check, wanted, TlsPaths.under(state_dir).server_cert)

    async def work(store: Store) -> bool:
        return await store_control_address.record(store, checked, "admin CLI", now_ms())

    run(with_store, state_dir, work)
    if not checked:
        click.echo("Nodes are no longer told an address; each keeps dialing its own.")
        return
    click.echo(
        f"Nodes will be told to dial {checked} when they next connect (the coordinator is not "
        "serving now)."
    )


def _show_control_address(state_dir: Path) -> None:
    async def work(store: Store) -> tuple[str, list[tuple[str, str, str, bool]]]:
        nodes = await node_views(store)
        rows = [(n.id, n.name, n.dialed_address, n.connected) for n in nodes]
        return await store_control_address.current(store), rows

    address, rows = run(with_store, state_dir, work)
    click.echo(f"Nodes are told to dial: {address or '(nothing set: each dials its own)'}")
    if not rows:
        return
    width = max(len(r[0]) for r in rows)
    named = max(len(r[1]) for r in rows)
    click.echo(f"{'NODE':<{width}}  {'NAME':<{named}}  CONNECTED  DIALED")
    for node_id, name, dialed, connected in rows:
        mark = "yes" if connected else "no"
        click.echo(f"{node_id:<{width}}  {name:<{named}}  {mark:<9}  {dialed or '-'}")
