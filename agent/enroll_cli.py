"""``tuneplane-node enroll``: trade a join token for a node id and a private control credential.

Rules: node.json is written last (its presence is what "enrolled" means); an enrolled state dir
is enrolled again only with ``--re-enroll``, which keeps the Node's id, journal and members.
Several ``--coordinator`` addresses (coordinators sharing one store) are asked in turn until one
answers; node.json dials that one first and keeps them all (agent/control_address.py).
"""

from __future__ import annotations

import time
from pathlib import Path

import click
import trio

from .adapter import open_aio_host
from .atomic_file import write_atomic
from .cli_gpu_source import gpu_source, one_gpu_source, scripted_nvml_option
from .cli_support import sentences, state_dir_option
from .inventory import Inventory, default_node_name
from .inventory_source import PROBE_LIMIT_S
from .journal import Journal
from .state_dir import AlreadyEnrolled, CredentialLife, NodeConfig, StateDir, StateDirError
from .wire import CoordinatorUnreachable, Endpoint
from .wire_control import Enrolled, enroll


@click.command("enroll")
@click.option(
    "--coordinator",
    "coordinator",
    required=True,
    multiple=True,
    help="The coordinator's control address HOST:PORT. Coordinators sharing one store (high "
    "availability): repeat it or give a comma list; enroll asks each in turn until the leader "
    "answers, and the Node keeps them all to follow the leader.",
)
@click.option(
    "--ca",
    "ca",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="The coordinator's CA certificate (its tls/ca.pem); copied into the state dir.",
)
@click.option("--token", required=True, help="A one-time join token from the coordinator.")
@state_dir_option
@click.option("--simulate-gpus", default=None, help="Report N simulated GPUs of SERIES (h200:2).")
@scripted_nvml_option
@click.option("--name", default=None, help="The Node's host name as the coordinator shows it.")
@click.option(
    "--re-enroll",
    "re_enroll",
    is_flag=True,
    help="This state dir is already a Node (revoked, or offline past its credential's expiry): "
    "get it a new control credential and keep its id, journal and running members.",
)
def enroll_command(
    coordinator: tuple[str, ...],
    ca: Path,
    token: str,
    state_dir: Path,
    simulate_gpus: str | None,
    scripted_nvml: Path | None,
    name: str | None,
    re_enroll: bool,
) -> None:
    """Trade a join token for a node id and a private control credential."""
    one_gpu_source(simulate_gpus, scripted_nvml)
    state = StateDir(state_dir)
    with sentences():
        existing: NodeConfig | None = None
        if re_enroll:
            existing = state.load_node()
        elif state.node_file.exists():
            found = state.load_node()
            raise AlreadyEnrolled(
                f"{state.root} is already enrolled as Node {found.node_id} with "
                f"{found.coordinator}. To give this same Node a new credential (after a revoke "
                "or an expiry) add --re-enroll; to enroll the machine as a new Node use an empty "
                "--state-dir."
            )
        endpoints = _endpoints(coordinator)
        try:
            ca_bytes = ca.read_bytes()
        except OSError as exc:
            raise StateDirError(
                f"The CA file {ca} cannot be read ({exc.strerror}); pass the coordinator's "
                "tls/ca.pem."
            ) from None
        node_name = name or (existing.name if existing else default_node_name())
        source = gpu_source(node_name, simulate_gpus, scripted_nvml)
        inventory = source.collect_within(PROBE_LIMIT_S)
        endpoint, enrolled = trio.run(
            _enroll, endpoints, ca, token, inventory, existing.node_id if existing else ""
        )
        state.create()
        write_atomic(state.ca_path, ca_bytes, 0o644)
        state.save_credential(
            enrolled.node_credential,
            CredentialLife(enrolled.credential_issued_at_ms, enrolled.credential_expires_at_ms),
        )
        at_ms = int(time.time() * 1000)
        trio.run(_journal_enrolment, state, enrolled.node_id, at_ms, existing is not None)
        # node.json last: its presence is what "enrolled" means.
        state.save_node(
            NodeConfig(
                node_id=enrolled.node_id,
                fleet=enrolled.fleet,
                coordinator=str(endpoint),
                name=node_name,
                ca=str(state.ca_path.resolve()),
                enrolled_at_ms=at_ms,
                coordinators=_listed(endpoints, existing),
            )
        )
    if existing is not None:
        click.echo(f"re-enrolled Node {enrolled.node_id} in Fleet {enrolled.fleet}")
        click.echo(
            "a running agent uses the new credential at its next reconnect; its members stay "
            "as they are"
        )
        return
    click.echo(f"enrolled as Node {enrolled.node_id} in Fleet {enrolled.fleet}")
    # The GPU source enrolled with is the one to run with: the coordinator placed on what the
    # enrolment's inventory said.
    same = f" --simulate-gpus {simulate_gpus}" if simulate_gpus else ""
    same += f" --scripted-nvml {scripted_nvml}" if scripted_nvml else ""
    click.echo(f"start it with: tuneplane-node run --state-dir {state.root}{same}")


def _endpoints(given: tuple[str, ...]) -> tuple[Endpoint, ...]:
    """Every ``--coordinator`` (each may be a comma list), in order, each once. Raises
    ValueError naming one that is not HOST:PORT."""
    texts = [t.strip() for each in given for t in each.split(",") if t.strip()]
    if not texts:
        raise ValueError(
            "--coordinator names no address; pass the coordinator's control address HOST:PORT."
        )
    return tuple(dict.fromkeys(Endpoint.parse(t) for t in texts))


def _listed(endpoints: tuple[Endpoint, ...], existing: NodeConfig | None) -> tuple[str, ...]:
    """node.json's ``coordinators``: every address given when there are several; with one, what
    a re-enrolled Node had (the next Welcome names them anyway)."""
    if len(endpoints) > 1:
        return tuple(str(e) for e in endpoints)
    return existing.coordinators if existing is not None else ()


async def _enroll(
    endpoints: tuple[Endpoint, ...], ca: Path, token: str, inventory: Inventory, node_id: str
) -> tuple[Endpoint, Enrolled]:
    """Enroll at the first coordinator that answers: a standby refuses connections until it
    leads, so an unreachable one is skipped; an answer (even a refusal) is final."""
    unreachable: list[CoordinatorUnreachable] = []
    async with open_aio_host():
        for endpoint in endpoints:
            try:
                return endpoint, await enroll(endpoint, ca, token, inventory, node_id)
            except CoordinatorUnreachable as exc:
                unreachable.append(exc)
    if len(unreachable) == 1:
        raise unreachable[0]
    raise CoordinatorUnreachable(
        f"None of the {len(endpoints)} coordinators answered: "
        + " ".join(str(e) for e in unreachable)
    )


async def _journal_enrolment(state: StateDir, node_id: str, at_ms: int, again: bool) -> None:
    async with open_aio_host():
        journal = await Journal.open(state.journal_path)
        try:
            await journal.set_meta("node_id", node_id)
            await journal.record_credential("control", at_ms)
            await journal.node_event(at_ms, "re-enrolled" if again else "enrolled", node_id=node_id)
        finally:
            await journal.close()
