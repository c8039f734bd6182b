"""``tuneplane-node status``: connectivity, last heartbeat ack, members and GPUs.

Rules: it reads the daemon's status file and opens the journal read-only, so it needs neither
the daemon nor the coordinator; the credential is shown by its age and expiry, never its value.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import click

from tuneplane.proto.contract import control_protocol

from . import journal_read, workload_checks
from .cli_settings import workload_policy
from .cli_support import sentences, state_dir_option
from .credential_renewal import credential_health, renewal_deadline_ms
from .state_dir import CredentialLife, StateDir, read_status


def _ago(value: int | None) -> str:
    if value is None:
        return "never"
    return f"{max(0.0, time.time() - value / 1000):.1f} s ago"


def pid_alive(pid: object) -> bool:
    """Whether ``pid`` (from the status file) is a live process (one we may not signal is)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@click.command("status")
@state_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def status_command(state_dir: Path, as_json: bool) -> None:
    """Connectivity, last heartbeat ack, members and GPUs, from the status file and journal."""
    state = StateDir(state_dir)
    with sentences():
        node = state.load_node()
        status = read_status(state.status_path) or {}
        running = pid_alive(status.get("pid"))
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
        "workload_warnings": workload_checks.warnings(workload_policy()),
        "credential": credential,
        "versions": _versions(status),
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
        click.echo(data["versions"]["summary"])
        if data["versions"]["skew_warning"]:
            click.echo(f"WARNING: {data['versions']['skew_warning']}")
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
                size = gib(dev["memory_bytes"])
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


def credential_line(state: StateDir) -> tuple[str, str]:
    """The control credential's health level ("ok", "warn", ...) and its sentence."""
    life = state.load_credential_life() or CredentialLife()
    return credential_health(life.issued_at_ms, life.expires_at_ms, int(time.time() * 1000))


def _credential_json(state: StateDir) -> dict[str, Any]:
    """The control credential's age and expiry for ``status`` (never its value)."""
    life = state.load_credential_life() or CredentialLife()
    level, text = credential_line(state)
    return {
        "issued_at_ms": life.issued_at_ms or None,
        "expires_at_ms": life.expires_at_ms or None,
        "renew_by_ms": renewal_deadline_ms(life.issued_at_ms, life.expires_at_ms) or None,
        "health": level,
        "summary": text,
    }


def gib(size: int) -> str:
    """A size in GiB with one decimal, as status and doctor show memory."""
    return f"{size / 2**30:.1f} GiB"


def _versions(status: dict[str, Any]) -> dict[str, Any]:
    """This agent's release and control protocol and the coordinator's, as the last Welcome
    said (proto/contract/control_protocol.py), with a sentence for each and any skew warning."""
    agent = status.get("agent_version") or "unknown"
    said = status.get("coordinator_protocol") or 0
    coordinator = control_protocol.Peer.said(
        status.get("coordinator_version") or "", said, status.get("coordinator_capabilities", [])
    )
    mine = f"agent {agent} (control protocol {status.get('protocol') or '?'})"
    summary = (
        f"versions: {mine}, coordinator {coordinator.text}"
        if said
        else f"versions: {mine}, coordinator not yet heard"
    )
    warning = control_protocol.coordinator_warning(coordinator, agent) if said else None
    return {
        "agent_version": agent,
        "protocol": status.get("protocol") or 0,
        "coordinator_version": coordinator.version if said else "",
        "coordinator_protocol": said,
        "coordinator_capabilities": sorted(coordinator.capabilities),
        "summary": summary,
        "skew_warning": warning or "",
    }
