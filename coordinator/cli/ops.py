"""``tp fleet`` and ``tp node``: read Fleets and Nodes; cordon, uncordon and drain Nodes.

Rules: the same exit codes and error sentences as the rest of ``tp`` (errors propagate to
``tp.main``); ``--json`` prints stable JSON and nothing else on stdout. Whether the caller may
cordon is decided by the coordinator, never here.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

import click

from ..values.fleet import Fleet, Node
from . import render, render_fleet
from .connection import Endpoint

if TYPE_CHECKING:
    from .api_client import ApiClient

T = TypeVar("T")


class HasEndpoint(Protocol):
    def endpoint(self) -> Endpoint: ...


def call(options: HasEndpoint, work: Callable[[ApiClient], Awaitable[T]]) -> T:
    """Run ``work`` against the coordinator the global flags name."""
    # Imported here for the same reason tp does: asyncio and grpclib cost start-up time.
    import asyncio

    from .api_client import ApiClient

    endpoint = options.endpoint()

    async def go() -> T:
        async with ApiClient(endpoint) as api:
            return await work(api)

    return asyncio.run(go())


def _now_ms() -> int:
    return int(time.time() * 1000)


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")


@click.group("fleet")
def fleet_group() -> None:
    """Fleets: where Jobs are placed, with their Nodes and GPUs."""


@fleet_group.command("ls")
@json_option
@click.pass_obj
def fleet_ls(options: HasEndpoint, as_json: bool) -> None:
    """List Fleets: Nodes, free GPUs per Series, quotas, queued and active Jobs."""

    async def work(api: ApiClient) -> list[Fleet]:
        return await api.list_fleets()

    fleets = call(options, work)
    if as_json:
        click.echo(render.to_json(fleets))
    elif not fleets:
        click.echo("No Fleets.")
    else:
        render.console().print(render_fleet.fleets_table(fleets))


@fleet_group.command("show")
@click.argument("fleet")
@json_option
@click.pass_obj
def fleet_show(options: HasEndpoint, fleet: str, as_json: bool) -> None:
    """Show FLEET: its Nodes counted, GPUs per Series with quota, and its Jobs."""

    async def work(api: ApiClient) -> Fleet:
        return await api.get_fleet(fleet)

    found = call(options, work)
    if as_json:
        click.echo(render.to_json(found))
        return
    out = render.console()
    for part in render_fleet.fleet_view(found):
        out.print(part)


@click.group("node")
def node_group() -> None:
    """Nodes: scheduling state, control connectivity, inventory and members."""


@node_group.command("ls")
@click.option("--fleet", default="", help="Only Nodes of this Fleet.")
@json_option
@click.pass_obj
def node_ls(options: HasEndpoint, fleet: str, as_json: bool) -> None:
    """List Nodes: scheduling state and control connectivity side by side."""

    async def work(api: ApiClient) -> list[Node]:
        return await api.list_nodes(fleet)

    nodes = call(options, work)
    if as_json:
        click.echo(render.to_json([render_fleet.node_json(n) for n in nodes]))
    elif not nodes:
        click.echo("No Nodes" + (f" in Fleet {fleet}." if fleet else " are enrolled."))
    else:
        render.console().print(render_fleet.nodes_table(nodes, _now_ms()))


@node_group.command("show")
@click.argument("node_id", metavar="NODE")
@json_option
@click.pass_obj
def node_show(options: HasEndpoint, node_id: str, as_json: bool) -> None:
    """Show NODE: scheduling, connectivity, CPUs, memory, GPUs and who holds them, members."""

    async def work(api: ApiClient) -> Node:
        return await api.get_node(node_id)

    found = call(options, work)
    if as_json:
        click.echo(render.to_json(render_fleet.node_json(found)))
        return
    out = render.console()
    for part in render_fleet.node_view(found, _now_ms()):
        out.print(part)


def _change(options: HasEndpoint, node_id: str, wanted: str, reason: str, as_json: bool) -> None:
    async def work(api: ApiClient) -> Node:
        return await api.set_node_scheduling(node_id, wanted, reason)

    node = call(options, work)
    if as_json:
        click.echo(render.to_json(render_fleet.node_json(node)))
        return
    held = len(node.members)
    connectivity = render_fleet.control(node, _now_ms())
    if node.scheduling == "schedulable":
        click.echo(f"Node {node.id} is schedulable: new members may be placed on it.")
    elif node.scheduling == "cordoned":
        click.echo(
            f"Node {node.id} is cordoned: no new members are placed on it; the {held} it holds "
            "keep running."
        )
    elif node.scheduling == "draining":
        click.echo(
            f"Node {node.id} is draining: no new members are placed on it; it shows drained "
            f"once its {held} member(s) end."
        )
    else:
        click.echo(f"Node {node.id} is drained: it holds no members and takes no new ones.")
    click.echo(f"Control: {connectivity}.")


reason_option = click.option("--reason", default="", help="Why; recorded in the decision log.")


@node_group.command("cordon")
@click.argument("node_id", metavar="NODE")
@reason_option
@json_option
@click.pass_obj
def node_cordon(options: HasEndpoint, node_id: str, reason: str, as_json: bool) -> None:
    """Stop placing new members on NODE (admin only); what runs there keeps running."""
    _change(options, node_id, "cordoned", reason, as_json)


@node_group.command("uncordon")
@click.argument("node_id", metavar="NODE")
@reason_option
@json_option
@click.pass_obj
def node_uncordon(options: HasEndpoint, node_id: str, reason: str, as_json: bool) -> None:
    """Let NODE take new members again, after cordon or drain (admin only)."""
    _change(options, node_id, "schedulable", reason, as_json)


@node_group.command("drain")
@click.argument("node_id", metavar="NODE")
@reason_option
@json_option
@click.pass_obj
def node_drain(options: HasEndpoint, node_id: str, reason: str, as_json: bool) -> None:
    """Stop placing on NODE and show it drained once its members end (admin only)."""
    _change(options, node_id, "draining", reason, as_json)
