"""``tuneplane-node journal …``: the on-call's offline reader of the member journal.

Rules: every command opens the journal read-only (agent/journal_read.py), works with the agent
running, stopped or crashed and never contacts the coordinator; ``--json`` prints what a script
reads, the plain form a table. The group is registered on ``tuneplane-node`` by agent/cli.py.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click

from . import journal_read
from .cli_support import duration_s, ms_text, sentences, state_dir_option
from .journal_records import EVENT_KINDS, MemberKey
from .state_dir import StateDir


@click.group("journal")
def journal_group() -> None:
    """Read this Node's member journal (read-only; works with the agent stopped or running)."""


def _since(value: str | None) -> int | None:
    if value is None:
        return None
    seconds = duration_s(value)
    if seconds is not None:
        return int((time.time() - seconds) * 1000)
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is neither a duration (30s, 10m, 2h, 1d) nor an ISO time "
            "(2026-01-31T12:00); pass one of those.",
            param_hint="--since",
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp() * 1000)


def _emit(rows: list[dict[str, Any]], columns: list[str], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("(none)")
        return
    cells = [[("-" if r.get(c) is None else str(r.get(c))) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    click.echo("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip())
    for row in cells:
        click.echo("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


def _journal_path(state_dir: Path) -> Path:
    return StateDir(state_dir).journal_path


@journal_group.command("members")
@state_dir_option
@click.option("--json", "as_json", is_flag=True)
def journal_members(state_dir: Path, as_json: bool) -> None:
    """Every member this Node has held, with its current state."""
    with sentences(), journal_read.open_readonly(_journal_path(state_dir)) as db:
        rows = [journal_read.member_json(r) for r in journal_read.members(db)]
    for row in rows:
        row["updated"] = ms_text(row["updated_at_ms"])
        row["exit"] = f"signal {row['signal']}" if row["signal"] is not None else row["exit_code"]
    _emit(rows, ["member", "state", "gpu_indexes", "updated", "exit", "reason"], as_json)


@journal_group.command("show")
@click.argument("member")
@state_dir_option
def journal_show(member: str, state_dir: Path) -> None:
    """One member: its record and its whole history."""
    with sentences():
        key = MemberKey.parse(member)
        with journal_read.open_readonly(_journal_path(state_dir)) as db:
            record = journal_read.member(db, key)
            history = journal_read.events(db, key=key)
        if record is None:
            raise ValueError(
                f"Member {member} is not in this journal; list them with "
                "`tuneplane-node journal members`."
            )
    for name, value in journal_read.member_json(record).items():
        click.echo(f"{name:>15}: {value}")
    click.echo("history:")
    for event in history:
        move = f"{event['from_state'] or '-'} -> {event['to_state'] or '-'}"
        click.echo(f"  {ms_text(event['at_ms'])}  {event['kind']:<18} {move:<26} {event['reason']}")


@journal_group.command("events")
@state_dir_option
@click.option("--since", default=None, help="A duration (10m, 2h) or an ISO time.")
@click.option("--member", default=None, help="Only this member (<run id>.<attempt>.<index>).")
@click.option(
    "--kind",
    "kinds",
    multiple=True,
    help="Only events of this kind (repeatable): agent-started, agent-stopped, "
    "member-reattached, exit-collected, exit-observed, …",
)
@click.option(
    "--node", "node_only", is_flag=True, help="Only the Node's own events (starts, stops, enrol)."
)
@click.option("--json", "as_json", is_flag=True)
def journal_events(
    state_dir: Path,
    since: str | None,
    member: str | None,
    kinds: tuple[str, ...],
    node_only: bool,
    as_json: bool,
) -> None:
    """The append-only event log, oldest first."""
    with sentences():
        key = MemberKey.parse(member) if member else None
        if key is not None and node_only:
            raise ValueError(
                "--member and --node contradict each other (Node events name no member); "
                "pass one of them."
            )
        with journal_read.open_readonly(_journal_path(state_dir)) as db:
            rows = journal_read.events(
                db, since_ms=_since(since), key=key, kinds=kinds, node_only=node_only
            )
            present = journal_read.event_kinds(db)
        # A kind this agent writes but that has not happened yet is an empty answer; a kind
        # neither written nor held is a typo, named with the choices.
        unknown = sorted(set(kinds) - EVENT_KINDS - set(present))
        if unknown:
            raise ValueError(
                f"--kind {', '.join(unknown)} is not an event kind; the kinds are "
                f"{', '.join(sorted(EVENT_KINDS | set(present)))}."
            )
    if not as_json:
        for row in rows:
            row["at"] = ms_text(row["at_ms"])
    _emit(rows, ["id", "at", "member", "kind", "from_state", "to_state", "reason"], as_json)


@journal_group.command("pending")
@state_dir_option
@click.option("--json", "as_json", is_flag=True)
def journal_pending(state_dir: Path, as_json: bool) -> None:
    """Reports the coordinator has not acknowledged yet, oldest first (resent on reconnect)."""
    with sentences(), journal_read.open_readonly(_journal_path(state_dir)) as db:
        rows = [journal_read.report_json(r) for r in journal_read.pending_reports(db)]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for row in rows:
        row["at"] = ms_text(row["at_ms"])
        row["exit"] = f"signal {row['signal']}" if row["signal"] is not None else row["exit_code"]
    _emit(rows, ["report_seq", "at", "member", "state", "exit", "reason"], False)


@journal_group.command("reservations")
@state_dir_option
@click.option("--json", "as_json", is_flag=True)
def journal_reservations(state_dir: Path, as_json: bool) -> None:
    """Which member owns which GPU (and how many reports wait: `journal pending` lists them)."""
    with sentences(), journal_read.open_readonly(_journal_path(state_dir)) as db:
        rows = journal_read.reservations(db)
        pending = [journal_read.report_json(r) for r in journal_read.pending_reports(db)]
    if as_json:
        # "pending_reports" stays for scripts written before `journal pending` existed.
        click.echo(json.dumps({"gpus": rows, "pending_reports": pending}, indent=2))
        return
    for row in rows:
        row["since"] = ms_text(row["since_ms"])
    _emit(rows, ["gpu_index", "member", "state", "since"], False)
    click.echo(f"pending reports: {len(pending)} (`tuneplane-node journal pending` lists them)")


@journal_group.command("gpus")
@state_dir_option
@click.option("--json", "as_json", is_flag=True)
def journal_gpus(state_dir: Path, as_json: bool) -> None:
    """GPUs that XIDs disable now, then every XID and clear, oldest first."""
    with sentences(), journal_read.open_readonly(_journal_path(state_dir)) as db:
        disabled = journal_read.disabled_gpus(db)
        history = journal_read.gpu_history(db)
    if as_json:
        click.echo(json.dumps({"disabled": disabled, "history": history}, indent=2))
        return
    click.echo("disabled by XIDs:")
    _emit(disabled, ["gpu_uuid", "why"], False)
    click.echo("history:")
    _emit(history, ["at", "gpu_uuid", "what", "disables", "detail"], False)


@journal_group.command("export")
@state_dir_option
@click.option("--json", "as_json", is_flag=True, required=True, help="Export as JSON (required).")
def journal_export(state_dir: Path, as_json: bool) -> None:
    """Everything in the journal as one JSON document (credential ages, never their values)."""
    with sentences(), journal_read.open_readonly(_journal_path(state_dir)) as db:
        data = journal_read.export(db)
    click.echo(json.dumps(data, indent=2))
