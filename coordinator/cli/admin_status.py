"""``tuneplane-coordinator status``: which coordinator leads, since when, its lease, the standbys.

Rules:
- It only reads, so it is safe anywhere and any time: on PostgreSQL the lease and the roll call
  (:mod:`tuneplane.coordinator.store.lease`, read on a connection of its own, nothing created);
  on SQLite, where one coordinator always leads, the state directory's ``endpoints.json``.
- Times are the database's clock; "seen 0.4 s ago" is measured against it, never against this
  machine's clock. A coordinator whose database session is gone is shown as ``gone``: it
  stopped, or lost its connection to the store.
- :func:`render` is pure (tested); ``--json`` prints the same facts as one object.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import attrs
import click

from ..config import load_config
from ..leadership import LeaseRow, LeaseSettings
from ..server.state_dir import ENDPOINTS
from ..store.handle import StoreUnavailable
from ..store.lease import CoordinatorRow
from ..store_location import PostgresUrl
from .admin_common import run, run_sync, state_dir_option


@attrs.frozen
class ClusterView:
    """What ``status`` read: the lease (None: never held) and the roll call, at ``now_ms``."""

    store: str
    lease: LeaseRow | None
    coordinators: tuple[CoordinatorRow, ...]
    now_ms: int
    settings: LeaseSettings


def _when(ms: int) -> str:
    moment = datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def as_json(view: ClusterView) -> dict[str, Any]:
    """The facts of ``view`` as one JSON object."""
    lease = view.lease
    rows = []
    for row in view.coordinators:
        seen_s = (view.now_ms - row.seen_ms) / 1000
        leads = lease is not None and lease.holder == row.facts.id
        rows.append(
            {
                **attrs.asdict(row.facts),
                "role": "leader" if leads else "standby",
                "seen_s_ago": round(seen_s, 3),
                "gone": not row.alive,
                "started_ms": row.started_ms,
            }
        )
    return {
        "store": view.store,
        "leader": lease.holder if lease is not None else "",
        "term": lease.term if lease is not None else 0,
        "leader_since_ms": lease.acquired_ms if lease is not None else 0,
        "lease_expires_in_s": (
            round((lease.expires_ms - view.now_ms) / 1000, 3) if lease is not None else 0
        ),
        "leader_session_alive": lease.holder_alive if lease is not None else False,
        "coordinators": rows,
    }


def render(view: ClusterView) -> list[str]:
    """``status``'s lines for ``view``."""
    facts = as_json(view)
    lines = [f"Store: {view.store} (coordinators sharing it elect one leader)"]
    lease = view.lease
    if lease is None:
        lines.append("Leader: none yet (no coordinator has served on this store).")
    else:
        left = facts["lease_expires_in_s"]
        state = f"lease expires in {left:.1f} s" if left > 0 else f"lease EXPIRED {-left:.1f} s ago"
        if not lease.holder_alive:
            state += "; its database session is gone, a standby takes over"
        lines.append(
            f"Leader: {lease.holder} since {_when(lease.acquired_ms)} (term {lease.term}), {state}"
        )
    if not view.coordinators:
        lines.append("Coordinators: none registered.")
    for row in facts["coordinators"]:
        mark = "gone" if row["gone"] else row["role"]
        lines.append(
            f"  {row['id']:<28} {mark:<8} seen {row['seen_s_ago']:.1f} s ago  host {row['host']} "
            f"pid {row['pid']} version {row['version']}"
        )
        lines.append(
            f"  {'':<28} api {row['api_address']}  control {row['control_address']}  "
            f"telemetry {row['telemetry_address']}"
        )
    return lines


async def read_view(url: PostgresUrl, settings: LeaseSettings) -> ClusterView:
    """The lease and roll call at ``url``, read only."""
    from ..store.lease import LeaseDesk

    desk = await LeaseDesk.open(url, create=False)
    try:
        now = await desk.now_ms()
        if not await desk.exists():
            return ClusterView(str(url), None, (), now, settings)
        return ClusterView(
            str(url), await desk.read(), tuple(await desk.roll_call()), now, settings
        )
    finally:
        await desk.close()


def _single(state_dir: Path) -> dict[str, Any]:
    try:
        endpoints = json.loads((state_dir / ENDPOINTS).read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        endpoints = {}
    return {"store": "sqlite", "serving": bool(endpoints), **endpoints}


@click.command(name="status")
@state_dir_option
@click.option("--json", "as_json_flag", is_flag=True, help="Print one JSON object.")
def status(state_dir: Path, as_json_flag: bool) -> None:
    """Show which coordinator leads, since when, its lease, and the standbys (coordinators
    sharing a PostgreSQL store); on SQLite, whether this state directory's coordinator serves.
    Only reads: safe while coordinators run."""
    config = run_sync(load_config, state_dir)
    if config.store_url is None:
        facts = _single(state_dir)
        if as_json_flag:
            click.echo(json.dumps(facts, sort_keys=True))
            return
        if facts["serving"]:
            click.echo(
                f"One coordinator on SQLite (standbys need a PostgreSQL store): serving, pid "
                f"{facts.get('pid')}, api {facts.get('api')}, control {facts.get('control')}."
            )
        else:
            click.echo(f"One coordinator on SQLite: not serving ({state_dir} has no endpoints).")
        return
    try:
        view = run(read_view, config.store_url, config.leader)
    except StoreUnavailable as exc:
        raise click.ClickException(str(exc)) from None
    if as_json_flag:
        click.echo(json.dumps(as_json(view), sort_keys=True))
        return
    for line in render(view):
        click.echo(line)
