"""``tuneplane-node``: enroll, run, status, doctor, journal (the on-call's offline reader), gpu.

Rules: every failure is a typed error turned into one sentence on stderr and exit status 1;
``journal``, ``status`` and ``doctor`` open the journal read-only and never need the daemon or
the coordinator. ``gpu clear`` is the one operator write: one journal transaction, safe while
the daemon runs (SQLite serialises writers), which the daemon reads at its next refresh.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import time
from pathlib import Path
from typing import Any

import attrs
import click
import trio

from tuneplane.collector.files import DEFAULT_MAX_FILES
from tuneplane.collector.system_sampler import DEFAULT_INTERVAL_S as SYSTEM_INTERVAL_S

from . import config as node_config
from . import (
    daemon_log,
    doctor,
    journal_read,
    outputs_identity,
    outputs_server,
    workload_checks,
)
from . import metrics as node_metrics
from .adapter import open_aio_host
from .atomic_file import write_atomic, write_json_atomic
from .cli_support import sentences as _sentences
from .cli_support import state_dir_option as _state_dir_option
from .credential_renewal import credential_health, renewal_deadline_ms
from .daemon import Daemon, run_daemon
from .daemon_base import INVENTORY_INTERVAL_S
from .inventory import (
    Inventory,
    InventoryError,
    SimulatedGpus,
    default_node_name,
    parse_simulate_gpus,
)
from .inventory_source import PROBE_LIMIT_S, RELEASE_REQUEST, InventorySource, read_release
from .journal import Journal
from .journal_cli import journal_group
from .journal_owner import owner_problem, stamped_node_id
from .metrics_listener import MetricsListener
from .sd_notify import ServiceNotifier
from .state_dir import (
    AlreadyEnrolled,
    CredentialLife,
    NodeConfig,
    StateDir,
    StateDirError,
    read_status,
)
from .wire import Endpoint
from .wire_control import Enrolled, enroll
from .xid_book import CLEAR_KINDS, XidRecord


@attrs.frozen
class _Settings:
    """node.toml as ``main`` read it (``values`` is None without a file), for the commands."""

    values: dict[str, Any] | None
    path: Path | None


def _metrics_listener() -> MetricsListener | None:
    """node.toml's [metrics] listener; None (off) without the table or without a node.toml."""
    found = click.get_current_context().find_root().obj
    if isinstance(found, _Settings) and found.values is not None:
        return node_config.metrics_settings(found.values, found.path)
    return None


def _outputs_settings() -> tuple[node_config.OutputsSettings, Path | None]:
    """node.toml's [outputs] (the default listener without the table or without a node.toml)."""
    found = click.get_current_context().find_root().obj
    if isinstance(found, _Settings) and found.values is not None:
        return node_config.outputs_settings(found.values, found.path), found.path
    return node_config.OutputsSettings(), None


def _workload_policy() -> node_config.WorkloadPolicy:
    """The workload policy of node.toml (or the safe default) for this agent's user."""
    found = click.get_current_context().find_root().obj
    if isinstance(found, _Settings):
        return workload_checks.policy_from(found.values, found.path)
    return workload_checks.policy_from(None, None)


_scripted_nvml_option = click.option(
    "--scripted-nvml",
    "scripted_nvml",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Read the GPUs from the scripted NVML test double driven by FILE (format in "
    "agent/scripted_nvml.py) instead of the real driver; not with --simulate-gpus.",
)


def _gpu_source(
    node_name: str,
    simulate_gpus: str | None,
    scripted_nvml: Path | None,
    release_request: Path | None = None,
    limit_s: float = PROBE_LIMIT_S,
) -> InventorySource:
    """The one GPU source the options name; a usage error for two of them."""
    _one_gpu_source(simulate_gpus, scripted_nvml)
    return InventorySource(
        node_name, _simulate(simulate_gpus), scripted_nvml, release_request, limit_s
    )


def _one_gpu_source(simulate_gpus: str | None, scripted_nvml: Path | None) -> None:
    if simulate_gpus is not None and scripted_nvml is not None:
        raise click.UsageError(
            "--simulate-gpus and --scripted-nvml cannot be used together; pass one of them."
        )


def _simulate(value: str | None) -> SimulatedGpus | None:
    if value is None:
        return None
    try:
        return parse_simulate_gpus(value)
    except InventoryError as exc:
        raise click.BadParameter(str(exc)) from None


def _ago(value: int | None) -> str:
    if value is None:
        return "never"
    return f"{max(0.0, time.time() - value / 1000):.1f} s ago"


def _setup_logging(level: str) -> None:
    daemon_log.configure(
        getattr(logging, level.upper()),
        "tuneplane-node",
        "%(asctime)s %(levelname)s %(name)s %(message)s",
    )


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
    ctx.obj = _Settings(settings if config_path is not None else None, config_path)


# --- enroll ------------------------------------------------------------------------------------


@main.command("enroll")
@click.option("--coordinator", required=True, help="The coordinator's control address HOST:PORT.")
@click.option(
    "--ca",
    "ca",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="The coordinator's CA certificate (its tls/ca.pem); copied into the state dir.",
)
@click.option("--token", required=True, help="A one-time join token from the coordinator.")
@_state_dir_option
@click.option("--simulate-gpus", default=None, help="Report N simulated GPUs of SERIES (h200:2).")
@_scripted_nvml_option
@click.option("--name", default=None, help="The Node's host name as the coordinator shows it.")
@click.option(
    "--re-enroll",
    "re_enroll",
    is_flag=True,
    help="This state dir is already a Node (revoked, or offline past its credential's expiry): "
    "get it a new control credential and keep its id, journal and running members.",
)
def enroll_command(
    coordinator: str,
    ca: Path,
    token: str,
    state_dir: Path,
    simulate_gpus: str | None,
    scripted_nvml: Path | None,
    name: str | None,
    re_enroll: bool,
) -> None:
    """Trade a join token for a node id and a private control credential."""
    _one_gpu_source(simulate_gpus, scripted_nvml)
    state = StateDir(state_dir)
    with _sentences():
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
        endpoint = Endpoint.parse(coordinator)
        try:
            ca_bytes = ca.read_bytes()
        except OSError as exc:
            raise StateDirError(
                f"The CA file {ca} cannot be read ({exc.strerror}); pass the coordinator's "
                "tls/ca.pem."
            ) from None
        node_name = name or (existing.name if existing else default_node_name())
        source = _gpu_source(node_name, simulate_gpus, scripted_nvml)
        inventory = source.collect_within(PROBE_LIMIT_S)
        enrolled = trio.run(
            _enroll, endpoint, ca, token, inventory, existing.node_id if existing else ""
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


async def _enroll(
    endpoint: Endpoint, ca: Path, token: str, inventory: Inventory, node_id: str
) -> Enrolled:
    async with open_aio_host():
        return await enroll(endpoint, ca, token, inventory, node_id)


async def _journal_enrolment(state: StateDir, node_id: str, at_ms: int, again: bool) -> None:
    async with open_aio_host():
        journal = await Journal.open(state.journal_path)
        try:
            await journal.set_meta("node_id", node_id)
            await journal.record_credential("control", at_ms)
            await journal.node_event(at_ms, "re-enrolled" if again else "enrolled", node_id=node_id)
        finally:
            await journal.close()


# --- run ---------------------------------------------------------------------------------------


@main.command("run")
@_state_dir_option
@click.option("--simulate-gpus", default=None, help="Report N simulated GPUs of SERIES (h200:2).")
@_scripted_nvml_option
@click.option(
    "--out-root",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where $TUNEPLANE_OUT_DIR of every member lives, outside the state dir (default: "
    "tuneplane-outputs beside the state dir).",
)
@click.option(
    "--work-root",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where members' work directories live, outside the state dir (default: "
    "tuneplane-work beside the state dir).",
)
@click.option("--log-level", default="info", type=click.Choice(["debug", "info", "warning"]))
@click.option(
    "--inventory-interval",
    "inventory_interval_s",
    type=click.FloatRange(min=0.1, max=3600),
    default=INVENTORY_INTERVAL_S,
    show_default=True,
    help="Seconds between GPU probes; also how soon a `tuneplane-node gpu clear` takes effect.",
)
@click.option(
    "--probe-limit",
    "probe_limit_s",
    type=click.FloatRange(min=0.1, max=600),
    default=PROBE_LIMIT_S,
    show_default=True,
    help="Seconds one GPU probe may take; a longer one is abandoned and the GPUs read "
    '"NVML unresponsive".',
)
@click.option(
    "--system-interval",
    "system_interval_s",
    type=click.FloatRange(min=0, max=3600),
    default=SYSTEM_INTERVAL_S,
    show_default=True,
    help="Seconds between samples of each member's GPUs and processes (system/... series); "
    "0 turns them off. node.toml: [telemetry] system_interval_s.",
)
@click.option(
    "--telemetry-max-files",
    "telemetry_max_files",
    type=click.IntRange(min=1, max=node_config.MAX_TELEMETRY_FILES),
    default=DEFAULT_MAX_FILES,
    show_default=True,
    help="The most telemetry files one member's collector follows at once; more are reported "
    "(tp job show), not read. node.toml: [telemetry] max_files.",
)
def run_command(
    state_dir: Path,
    simulate_gpus: str | None,
    scripted_nvml: Path | None,
    out_root: Path | None,
    work_root: Path | None,
    log_level: str,
    inventory_interval_s: float,
    probe_limit_s: float,
    system_interval_s: float,
    telemetry_max_files: int,
) -> None:
    """Run the agent until SIGTERM/SIGINT (which stop it and leave every member running)."""
    _setup_logging(log_level)
    # Taken out of the environment before anything is started: no runner, collector or
    # workload may talk to systemd as the agent.
    notifier = ServiceNotifier.from_environment()
    _one_gpu_source(simulate_gpus, scripted_nvml)
    if not state_dir.is_absolute():
        # Every runner the agent starts works from its own directory and finds its member by the
        # paths the journal holds: a relative one would point somewhere else there.
        raise click.UsageError(
            f"--state-dir {state_dir} is a relative path, but the agent and the runners it "
            "starts must find it from any working directory. Pass an absolute path, for "
            f"example --state-dir {state_dir.absolute()}."
        )
    state = StateDir(state_dir)
    with _sentences():
        node = state.load_node()
        credential = state.read_credential()
        state.create()
        outputs = (out_root or workload_checks.default_out_root(state.root)).resolve()
        works = (work_root or workload_checks.default_work_root(state.root)).resolve()
        policy = _workload_policy()
        refused = workload_checks.start_problems(policy, state.root, works, outputs)
        if refused:
            raise click.ClickException(" ".join(refused))
        for warning in workload_checks.warnings(policy):
            logging.getLogger(__name__).warning("workload policy warning=%s", warning)
        # Members must be able to pass through the roots to their own 0700 directories.
        for root in (outputs, works):
            root.mkdir(mode=0o711, parents=True, exist_ok=True)
        source = _gpu_source(
            node.name, simulate_gpus, scripted_nvml, state.root / RELEASE_REQUEST, probe_limit_s
        )
        # Bound before the journal is opened: a taken port stops the agent with nothing changed.
        served, toml = _outputs_settings()
        bound = None
        if served.on:
            identity = outputs_identity.load_or_create(state.credentials_dir, node.node_id)
            try:
                bound = outputs_server.bind(served, identity, toml)
            except outputs_server.OutputsListenFailed as exc:
                raise click.ClickException(str(exc)) from None
        daemon = Daemon(
            state, node, credential, source, outputs, work_root=works, policy=policy,
            inventory_interval_s=inventory_interval_s, system_interval_s=system_interval_s,
            telemetry_max_files=telemetry_max_files, outputs=bound,
        )  # fmt: skip
        logging.getLogger(__name__).info(
            "agent starting node_id=%s coordinator=%s gpus=%d gpu_source=%s pid=%d",
            node.node_id, node.coordinator, len(daemon.inventory.gpus),
            daemon.inventory.gpu_source, os.getpid(),
        )  # fmt: skip
        # Bound before the journal is opened: a taken port stops the agent with nothing changed.
        with node_metrics.serving(_metrics_listener()) as metrics_address:
            daemon.status.metrics_address = metrics_address
            trio.run(run_daemon, daemon, notifier)


# --- status ------------------------------------------------------------------------------------


def _pid_alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@main.command("status")
@_state_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def status_command(state_dir: Path, as_json: bool) -> None:
    """Connectivity, last heartbeat ack, members and GPUs, from the status file and journal."""
    state = StateDir(state_dir)
    with _sentences():
        node = state.load_node()
        status = read_status(state.status_path) or {}
        running = _pid_alive(status.get("pid"))
        members: list[dict[str, Any]] = []
        reservations: list[dict[str, Any]] = []
        pending = 0
        journal_problem = ""
        try:
            with journal_read.open_readonly(state.journal_path) as db:
                members = [journal_read.member_json(r) for r in journal_read.members(db)]
                reservations = journal_read.reservations(db)
                pending = len(journal_read.pending_reports(db))
        except journal_read.JournalUnreadable as exc:
            journal_problem = str(exc)
    credential = _credential_json(state)
    data = {
        "node_id": node.node_id,
        "fleet": node.fleet,
        "coordinator": node.coordinator,
        "agent_running": running,
        "connected": bool(running and status.get("connected")),
        "last_heartbeat_ack_ms": status.get("last_heartbeat_ack_ms"),
        "last_error": status.get("last_error", ""),
        "safe_mode": bool(status.get("safe_mode")),
        "safe_mode_reason": status.get("safe_mode_reason", ""),
        "inventory": status.get("inventory", {}),
        "members": members,
        "reservations": reservations,
        "pending_reports": pending,
        "journal_problem": journal_problem,
        "workload_warnings": workload_checks.warnings(_workload_policy()),
        "credential": credential,
    }
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    click.echo(f"Node {node.node_id} (Fleet {node.fleet}), coordinator {node.coordinator}")
    if not running:
        click.echo("agent: NOT RUNNING (no live daemon for this state dir)")
        if status.get("last_heartbeat_ack_ms"):
            # The dead daemon's last status file still says when the coordinator last answered.
            ack = _ago(status.get("last_heartbeat_ack_ms"))
            click.echo(f"last heartbeat ack before it stopped: {ack}")
    else:
        conn = "connected" if data["connected"] else "DISCONNECTED"
        click.echo(f"agent: running (pid {status.get('pid')}), {conn}")
        click.echo(f"last heartbeat ack: {_ago(status.get('last_heartbeat_ack_ms'))}")
        if status.get("metrics_address"):
            click.echo(f"metrics: http://{status['metrics_address']}/metrics")
        if status.get("outputs_listen"):
            click.echo(
                f"outputs listener: {status['outputs_listen']} (advertised as "
                f"{status.get('outputs_address') or 'not yet said'})"
            )
        if data["last_error"]:
            click.echo(f"last error: {data['last_error']}")
    if data["safe_mode"]:
        click.echo(f"SAFE MODE: {data['safe_mode_reason']}")
    for warning in data["workload_warnings"]:
        click.echo(f"WARNING: {warning}")
    click.echo(credential["summary"])
    if journal_problem:
        click.echo(f"journal: {journal_problem}")
    inv = data["inventory"]
    # Reservations are by UUID; one an older agent made without a UUID is matched by index.
    owners = {r["gpu_uuid"] or r["gpu_index"]: r["member"] for r in reservations}
    if inv:
        click.echo(f"GPUs ({inv.get('gpu_source')}): {len(inv.get('gpus', []))}")
        if inv.get("note"):
            click.echo(f"  {inv['note']}")
        if inv.get("problem"):
            click.echo(f"  NVML PROBLEM: {inv['problem']}")
        for gpu in inv.get("gpus", []):
            health = "healthy" if gpu["healthy"] else f"UNHEALTHY ({gpu['health_reason']})"
            owner = owners.get(gpu["uuid"]) or owners.get(gpu["index"], "free")
            click.echo(f"  {gpu['index']}  {gpu['uuid']}  {gpu['name']}  {health}  {owner}")
            for dev in gpu.get("mig_devices", []):
                size = _gib(dev["memory_bytes"])
                click.echo(f"      MIG device {dev['uuid']}  {dev['profile']}  {size}")
        if inv.get("xid_events"):
            click.echo(f"  XID events: {inv['xid_events']}")
    active = [mb for mb in members if mb["state"] not in ("exited", "aborted", "lost")]
    if journal_problem:
        click.echo(
            "members: unknown (the journal cannot be read); the runners' own records are in "
            f"{state.members_dir}/*/runner.json and exit.json"
        )
    else:
        click.echo(f"members: {len(active)} active, {len(members)} in the journal")
    if pending:
        click.echo(
            f"reports not yet acknowledged by the coordinator: {pending} "
            "(resent after the next reconnect)"
        )
    for mb in active:
        click.echo(f"  {mb['member']}  {mb['state']}  gpus {mb['gpu_indexes']}")


def _credential_line(state: StateDir) -> tuple[str, str]:
    life = state.load_credential_life() or CredentialLife()
    return credential_health(life.issued_at_ms, life.expires_at_ms, int(time.time() * 1000))


def _credential_json(state: StateDir) -> dict[str, Any]:
    """The control credential's age and expiry for ``status`` (never its value)."""
    life = state.load_credential_life() or CredentialLife()
    level, text = _credential_line(state)
    return {
        "issued_at_ms": life.issued_at_ms or None,
        "expires_at_ms": life.expires_at_ms or None,
        "renew_by_ms": renewal_deadline_ms(life.issued_at_ms, life.expires_at_ms) or None,
        "health": level,
        "summary": text,
    }


# --- doctor ------------------------------------------------------------------------------------


def _doctor_inventory(
    state: StateDir, node_name: str, scripted_nvml: Path | None
) -> Inventory | str | None:
    """What doctor reads the GPUs from: the inventory, why it failed, or None while released."""
    if read_release(state.root / RELEASE_REQUEST) > int(time.time() * 1000):
        return None
    try:
        return InventorySource(node_name, None, scripted_nvml).collect_within(PROBE_LIMIT_S)
    except InventoryError as exc:
        return str(exc)


def _gpu_doctor_lines(
    state: StateDir, read: Inventory | str | None
) -> list[tuple[bool | None, str]]:
    """What NVML says, read as the agent reads it: (ok, text); ``None`` is a plain detail."""
    if read is None:
        released = read_release(state.root / RELEASE_REQUEST)
        until = time.strftime("%H:%M:%S", time.gmtime(released / 1000))
        return [
            (
                True,
                f"NVML is released for a GPU reset until {until} UTC (tuneplane-node gpu "
                "release); doctor leaves it alone too",
            )
        ]
    if isinstance(read, str):
        return [(False, read)]
    inv = read
    where = f" ({inv.gpu_source})" if inv.gpu_source != "nvml" else ""
    if inv.problem:
        lines: list[tuple[bool | None, str]] = [(False, f"NVML{where}: {inv.problem}")]
    elif not inv.gpus:
        devices = sorted(str(p) for p in Path("/dev").glob("nvidia[0-9]*"))
        if inv.gpu_source == "none" and devices:
            return [
                (
                    False,
                    f"{inv.note}, but {devices[0]} exists: the driver's user-space libraries "
                    "(libnvidia-ml.so.1) are missing or not on the library path; reinstall the "
                    "driver package",
                )
            ]
        return [(True, inv.note or f"NVML{where}: no GPUs")]
    else:
        lines = [
            (
                True,
                f"NVML{where}: {len(inv.gpus)} GPUs, driver {inv.driver_version or '?'}, "
                f"CUDA {inv.cuda_version or '?'}",
            )
        ]
    for gpu in inv.gpus:
        health = "healthy" if gpu.healthy else f"UNHEALTHY: {gpu.health_reason}"
        mig = ", MIG enabled" if gpu.mig_enabled else ""
        lines.append((gpu.healthy, f"GPU {gpu.index} {gpu.uuid} {gpu.name}{mig}: {health}"))
        for dev in gpu.mig_devices:
            lines.append((None, f"  MIG device {dev.uuid} {dev.profile} {_gib(dev.memory_bytes)}"))
    if inv.xid_events:
        events_ok = inv.xid_events.startswith("registered on all")
        lines.append((events_ok, f"XID events: {inv.xid_events}"))
    return lines


def _gib(size: int) -> str:
    return f"{size / 2**30:.1f} GiB"


@main.command("doctor")
@_state_dir_option
@_scripted_nvml_option
def doctor_command(state_dir: Path, scripted_nvml: Path | None) -> None:
    """Check the state dir, the credential, the journal, the GPU source and NVML, the runtimes,
    the coordinator's address and clock, and free disk space."""
    state = StateDir(state_dir)
    failures = 0
    node: NodeConfig | None = None

    def line(ok: bool, text: str) -> None:
        nonlocal failures
        failures += not ok
        click.echo(f"{'ok  ' if ok else 'FAIL'}  {text}")

    def finding(found: workload_checks.Finding) -> None:
        nonlocal failures
        failures += found.level == "FAIL"
        click.echo(f"{found.level.ljust(4)}  {found.text}")

    node_id = ""
    node_name = default_node_name()
    problems = state.permission_problems()
    line(not problems, "state dir permissions" + (": " + " ".join(problems) if problems else ""))
    try:
        node = state.load_node()
        node_id = node.node_id
        node_name = node.name
        line(True, f"enrolled as Node {node.node_id} with {node.coordinator}")
        line(Path(node.ca).is_file(), f"CA file {node.ca}")
    except StateDirError as exc:
        line(False, str(exc))
    try:
        state.read_credential()
        line(True, f"control credential present ({state.control_token})")
        level, text = _credential_line(state)
        if level == "warn":
            click.echo(f"warn  {text}")
        else:
            line(level == "ok", text)
    except StateDirError as exc:
        line(False, str(exc))
    try:
        with journal_read.open_readonly(state.journal_path) as db:
            bad = journal_read.integrity_problems(db)
            stamped = None if bad else stamped_node_id(db)
        detail = (": " + "; ".join(bad[:3])) if bad else ""
        line(not bad, f"journal integrity {state.journal_path}{detail}")
        if not bad and node_id:
            problem = owner_problem(state.journal_path, stamped, node_id)
            line(problem is None, f"journal owner: {problem or 'Node ' + node_id}")
    except journal_read.JournalUnreadable as exc:
        line(False, f"journal integrity: {exc} The agent runs in safe mode until it is repaired.")
    read = _doctor_inventory(state, node_name, scripted_nvml)
    status = read_status(state.status_path) or {}
    if read is not None:  # None: NVML is released, the GPU line below says so
        pid = status.get("pid")
        running = pid if _pid_alive(pid) and isinstance(pid, int) else None
        mine, count = (
            (read.gpu_source, len(read.gpus))
            if isinstance(read, Inventory)
            else ("nothing (its GPU read failed, see below)", 0)
        )
        finding(
            doctor.inventory_source_finding(running, status.get("inventory") or {}, mine, count)
        )
    for ok, text in _gpu_doctor_lines(state, read):
        if ok is None:
            click.echo(f"      {text}")
        else:
            line(ok, text)
    for text in _xid_doctor_lines(state):
        click.echo(text)
    failures += _workload_lines(state.root)
    if node is not None:
        finding(doctor.probe_coordinator(node.coordinator, Path(node.ca)))
        gateway = doctor.telemetry_address(state.root)
        if gateway:
            finding(doctor.probe_coordinator(gateway, Path(node.ca), listener="telemetry"))
        else:
            click.echo(
                "      coordinator telemetry address: not known yet (the coordinator hands it "
                "out with each Commit; this Node has had none)"
            )
        skew = status.get("clock_skew_ms")
        at = status.get("clock_skew_at_ms")
        finding(
            doctor.skew_finding(
                skew if isinstance(skew, int) else None,
                at if isinstance(at, int) else None,
                int(time.time() * 1000),
            )
        )
    # The roots the agent last ran with (status.json), else those node.toml or the defaults set.
    works, outputs = _roots(state.root)
    works = Path(status.get("work_root") or works)
    outputs = Path(status.get("out_root") or outputs)
    for label, root in (("state dir", state.root), ("work root", works), ("output root", outputs)):
        finding(doctor.measure_disk(label, root))
    served, _ = _outputs_settings()
    pid = status.get("pid")
    finding(
        doctor.outputs_finding(
            served.listen,
            _pid_alive(pid),
            str(status.get("outputs_listen") or ""),
            str(status.get("outputs_address") or ""),
        )
    )
    if failures:
        raise SystemExit(1)


def _xid_doctor_lines(state: StateDir) -> list[str]:
    """Doctor's XID lines from the journal: each GPU XIDs disable (warn), then the history."""
    try:
        with journal_read.open_readonly(state.journal_path) as db:
            disabled = journal_read.disabled_gpus(db)
            book = journal_read.xid_book(db)
    except journal_read.JournalUnreadable:
        return []  # the journal lines above already said why
    lines = [
        f"warn  GPU {d['gpu_uuid']} is disabled by {d['why']}; after a reset or a check run "
        f"`tuneplane-node gpu clear {d['gpu_uuid']} --reason ...`"
        for d in disabled
    ]
    application = sum(x.application for x in book.xids)
    clears = sum(e.kind in CLEAR_KINDS for e in book.events)
    lines.append(
        f"      XID history: {len(book.xids)} XIDs journaled ({application} application, "
        f"counted only), {clears} clears; `tuneplane-node journal gpus` lists them"
    )
    return lines


def _roots(state_dir: Path) -> tuple[Path, Path]:
    """The work and output roots node.toml sets (or their defaults beside the state dir)."""
    settings = click.get_current_context().find_root().obj
    known = (settings.values if isinstance(settings, _Settings) else None) or {}
    outputs = Path(known.get("out_root") or workload_checks.default_out_root(state_dir))
    works = Path(known.get("work_root") or workload_checks.default_work_root(state_dir))
    return works, outputs


def _workload_lines(state_dir: Path) -> int:
    """Print doctor's workload-policy lines (accounts, runtimes, bubblewrap); the failures."""
    try:
        policy = _workload_policy()
    except node_config.NodeConfigError as exc:
        click.echo(f"FAIL  {exc}")
        return 1
    works, outputs = _roots(state_dir)
    failures = 0
    for finding in workload_checks.doctor_findings(policy, state_dir, works, outputs):
        failures += finding.level == "FAIL"
        click.echo(f"{finding.level.ljust(4)}  {finding.text}")
    return failures


# --- gpu -----------------------------------------------------------------------------------


@main.group("gpu")
def gpu_group() -> None:
    """Operator actions on this Node's GPUs, recorded in the journal."""


MAX_CLEAR_REASON = 500


@gpu_group.command("clear")
@click.argument("uuid")
@click.option(
    "--reason", required=True, help="Why the GPU may be used again (kept in the journal)."
)
@_state_dir_option
def gpu_clear(uuid: str, reason: str, state_dir: Path) -> None:
    """Put a GPU that XIDs disabled back into service (after a reset or a check)."""
    with _sentences():
        lifted = trio.run(_clear_gpu, StateDir(state_dir), uuid.strip(), reason.strip())
    click.echo(
        f"cleared {uuid.strip()}: XID {lifted.xid} no longer disables it; the running agent "
        "offers it again at its next inventory refresh"
    )


def _user() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return f"uid {os.getuid()}"


async def _clear_gpu(state: StateDir, uuid: str, reason: str) -> XidRecord:
    if not uuid:
        raise ValueError("The GPU UUID is empty; copy it from `tuneplane-node journal gpus`.")
    if not reason or len(reason) > MAX_CLEAR_REASON:
        raise ValueError(
            f"--reason must say in 1 to {MAX_CLEAR_REASON} characters why the GPU may be used "
            "again (for example: reset with nvidia-smi -r, checks passed)."
        )
    path = state.journal_path
    if not path.exists():
        raise journal_read.JournalUnreadable(
            f"There is no journal at {path}; pass the --state-dir of an enrolled Node."
        )
    actor = f"operator {_user()}"
    async with open_aio_host():
        journal = await Journal.open(path)
        try:
            lifted = await journal.clear_gpu(uuid, int(time.time() * 1000), actor, reason)
        finally:
            await journal.close()
    if lifted is None:
        raise ValueError(
            f"No XID disables GPU {uuid} in the journal {path}, so there is nothing to clear "
            "and nothing was written; `tuneplane-node journal gpus` lists the GPUs XIDs disable."
        )
    return lifted


MAX_RELEASE_MINUTES = 240


@gpu_group.command("release")
@click.option(
    "--minutes",
    type=click.IntRange(1, MAX_RELEASE_MINUTES),
    default=15,
    show_default=True,
    help="How long the agent keeps its hands off NVML; it takes NVML back after that.",
)
@click.option("--end", is_flag=True, help="End a release now: the agent takes NVML back.")
@click.option(
    "--wait",
    "wait_s",
    type=click.FloatRange(0, 3600),
    default=120.0,
    show_default=True,
    help="Seconds to wait for the running agent to say it let go (it reads the request at its "
    "next inventory refresh).",
)
@_state_dir_option
def gpu_release(minutes: int, end: bool, wait_s: float, state_dir: Path) -> None:
    """Have the running agent let go of NVML so `nvidia-smi -r` can reset a GPU.

    While released, every GPU of the Node reads unhealthy ("NVML released for a GPU reset by
    the operator") and nothing is launched on it; running members are left alone.
    """
    state = StateDir(state_dir)
    with _sentences():
        state.load_node()
        now = int(time.time() * 1000)
        until = 0 if end else now + minutes * 60_000
        request = {"until_ms": until, "requested_at_ms": now, "by": _user()}
        write_json_atomic(state.root / RELEASE_REQUEST, request, 0o600)
        status = read_status(state.status_path) or {}
        if not _pid_alive(status.get("pid")):
            click.echo(
                "No agent runs for this state dir; the request is stored and the agent honours "
                "it when it starts."
            )
            return

        def taken() -> bool:
            inv = (read_status(state.status_path) or {}).get("inventory", {})
            return bool(inv.get("released_until_ms", 0) == until)

        deadline = time.monotonic() + wait_s
        while not taken():
            if time.monotonic() >= deadline:
                raise click.ClickException(
                    f"The agent did not confirm within {wait_s:g} s (it reads the request at "
                    "its next inventory refresh, --inventory-interval); the request stays, so "
                    "check `tuneplane-node status` before resetting a GPU."
                )
            time.sleep(0.2)
    if end:
        click.echo("The agent has NVML again and probes the GPUs as usual.")
    else:
        at = time.strftime("%H:%M:%S", time.gmtime(until / 1000))
        click.echo(
            f"The agent let go of NVML until {at} UTC: reset the GPU now (nvidia-smi -r -i "
            "UUID), then end the release with `tuneplane-node gpu release --end`."
        )


# The on-call's offline reader is its own module (agent/journal_cli.py), on this same group.
main.add_command(journal_group)

if __name__ == "__main__":
    main()
