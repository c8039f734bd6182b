"""How ``tp`` shows Fleets and Nodes: to people, and as JSON for scripts (a Fleet through
:func:`render.to_json`, a Node through :func:`node_json`).

Rules: a Node's scheduling state and its control connectivity are always shown as two separate
things; a time is shown with how long ago it was; nothing the coordinator reported is hidden (an
empty list says so). A Node's JSON keeps the shape scripts read: its inventory's fields at the
top, each GPU with who holds it (``<run id>/<attempt>/<member>``, empty when free), each member
with its run id, attempt and index.
"""

from __future__ import annotations

from typing import Any

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from ..values.fleet import Fleet, Node, SeriesCapacity, SlurmPartition
from .render import heading, pairs, when


def _holder(node: Node, index: int) -> str:
    """Who holds GPU ``index`` of ``node`` (``<run id>/<attempt>/<member>``); "" when free."""
    held = node.held_by.get(index)
    return held.text if held is not None else ""


def node_json(node: Node) -> dict[str, Any]:
    """``node`` as ``tp node ls/show --json`` prints it."""
    inv = node.inventory
    return {
        "id": node.id,
        "name": node.name,
        "fleet": node.fleet,
        "hostname": node.hostname,
        "scheduling": node.scheduling,
        "scheduling_reason": node.scheduling_reason,
        "scheduling_changed_at_ms": node.scheduling_changed_at_ms,
        "scheduling_changed_by": node.scheduling_changed_by,
        "connected": node.connected,
        "disconnected_since_ms": node.disconnected_since_ms,
        "last_heartbeat_ms": node.last_heartbeat_ms,
        "enrolled_at_ms": node.enrolled_at_ms,
        "cpu_count": inv.cpu_count,
        "memory_bytes": inv.memory_bytes,
        "gpu_source": inv.gpu_source,
        "driver_version": inv.driver_version,
        "cuda_version": inv.cuda_version,
        "gpus": [
            {
                "index": g.index,
                "uuid": g.uuid,
                "name": g.name,
                "series": g.series,
                "memory_bytes": g.memory_bytes,
                "healthy": g.healthy,
                "health_reason": g.health_reason,
                "held_by": _holder(node, g.index),
            }
            for g in inv.gpus
        ],
        "members": [
            {
                "run_id": m.member.run_id,
                "attempt": m.member.attempt,
                "member_index": m.member.member_index,
                "state": m.state,
                "gpu_indexes": list(m.gpu_indexes),
                "owner": m.owner,
            }
            for m in node.members
        ],
        "credential_issued_at_ms": node.credential_issued_at_ms,
        "credential_expires_at_ms": node.credential_expires_at_ms,
        "revoked_at_ms": node.revoked_at_ms,
        "dialed_address": node.dialed_address,
        "outputs_address": node.outputs_address,
    }


def ago(ms: int, now_ms: int) -> str:
    """``2026-11-29 10:00:00 UTC (12s ago)``, or '-' for an unknown time."""
    if ms <= 0:
        return "-"
    secs = max(0, (now_ms - ms) // 1000)
    if secs < 120:
        rel = f"{secs}s"
    elif secs < 7200:
        rel = f"{secs // 60}m"
    elif secs < 172800:
        rel = f"{secs // 3600}h"
    else:
        rel = f"{secs // 86400}d"
    return f"{when(ms)} ({rel} ago)"


def control(node: Node, now_ms: int) -> str:
    if node.connected:
        return "connected"
    if node.disconnected_since_ms:
        return f"disconnected since {ago(node.disconnected_since_ms, now_ms)}"
    return "disconnected"


def credential(node: Node, now_ms: int) -> str:
    """The control credential's state: revoked, expired, or when it expires (never its value)."""
    if node.revoked_at_ms:
        return f"REVOKED at {when(node.revoked_at_ms)} (re-enroll the Node to use it again)"
    if not node.credential_expires_at_ms:
        return "no expiry recorded (set at its next connection)"
    if node.credential_expires_at_ms <= now_ms:
        return f"EXPIRED at {when(node.credential_expires_at_ms)} (re-enroll the Node)"
    issued = ago(node.credential_issued_at_ms, now_ms)
    return f"expires {when(node.credential_expires_at_ms)}, issued {issued}"


def _capacity_text(c: SeriesCapacity) -> str:
    text = f"{c.series} {c.free} free/{c.healthy} healthy"
    if c.healthy != c.total:
        text += f"/{c.total} total"
    if c.quota:
        text += f", quota {c.in_use}/{c.quota} in use"
    return text


def fleets_table(fleets: list[Fleet]) -> Table:
    table = Table(box=None, pad_edge=False)
    for column in ("FLEET", "KIND", "NODES", "CONNECTED", "SCHEDULABLE", "GPUS", "QUEUED"):
        table.add_column(column, no_wrap=True)
    table.add_column("ACTIVE", no_wrap=True)
    for f in fleets:
        table.add_row(
            f.name,
            f.kind,
            str(f.nodes),
            str(f.connected_nodes),
            str(f.schedulable_nodes),
            "; ".join(_capacity_text(c) for c in f.capacity) or "none",
            str(f.queued_jobs),
            str(f.active_jobs),
        )
    return table


def fleet_view(fleet: Fleet) -> list[RenderableType]:
    rows = [("Fleet", fleet.name), ("Kind", fleet.kind), ("Created", when(fleet.created_at_ms))]
    if fleet.slurm is None:
        rows.append(
            (
                "Nodes",
                f"{fleet.nodes} enrolled, {fleet.connected_nodes} connected, "
                f"{fleet.schedulable_nodes} schedulable",
            )
        )
    rows.append(("Jobs", f"{fleet.queued_jobs} queued, {fleet.active_jobs} active"))
    parts: list[RenderableType] = [pairs(rows)]
    if fleet.slurm is not None:
        # No Node enrolls into a Slurm Fleet: its machines and GPUs are the partition's.
        parts.extend(_slurm_view(fleet.slurm))
        return parts
    parts.append(heading("GPUs per Series"))
    table = Table()
    for column in ("SERIES", "TOTAL", "HEALTHY", "FREE", "IN USE", "QUOTA"):
        table.add_column(column)
    for c in fleet.capacity:
        table.add_row(
            c.series,
            str(c.total),
            str(c.healthy),
            str(c.free),
            str(c.in_use),
            str(c.quota) if c.quota else "none",
        )
    if not fleet.capacity:
        table.add_row("(no GPUs reported)", "", "", "", "", "")
    parts.append(table)
    return parts


def _slurm_view(slurm: SlurmPartition) -> list[RenderableType]:
    """A slurm Fleet's partition, as slurmrestd reported it while ``tp fleet show`` asked."""
    parts: list[RenderableType] = [
        heading(f"Slurm partition {slurm.partition} (slurmrestd {slurm.slurmrestd})")
    ]
    # The Fleet's own settings: shown even when slurmrestd could not be read.
    if slurm.series:
        mapped = Table()
        for column in ("SERIES", "GRES", "CONSTRAINT"):
            mapped.add_column(column)
        for m in slurm.series:
            mapped.add_row(m.series, f"gpu:{m.gres_type}" if m.gres_type else "any gpu",
                           m.constraint or "-")  # fmt: skip
        parts.append(mapped)
    else:
        parts.append("Series: none mapped; every Series asks for GPUs of any type.")
    if slurm.image_root:
        reached = slurm.registries_file or "the system's CAs, no credentials"
        parts.append(f"Images: cached in {slurm.image_root} on each node; registries: {reached}.")
    else:
        parts.append("Images: not run (the Fleet has no --image-root).")
    if slurm.error:
        parts.append(f"Not read: {slurm.error}")
        return parts
    table = Table()
    for column in ("NODE", "STATE", "CPUS", "GPUS", "GPUS IN USE", "GRES"):
        table.add_column(column)
    for n in slurm.nodes:
        table.add_row(n.name, n.state, str(n.cpus), str(n.gpus), str(n.gpus_used), n.gres)
    if not slurm.nodes:
        table.add_row("(no nodes in this partition)", "", "", "", "", "")
    parts.append(table)
    return parts


def _gpu_summary(node: Node) -> str:
    by_series: dict[str, list[int]] = {}
    for g in node.inventory.gpus:
        c = by_series.setdefault(g.series, [0, 0, 0])  # total, healthy, free
        c[0] += 1
        c[1] += g.healthy
        c[2] += g.healthy and g.index not in node.held_by
    return (
        "; ".join(
            f"{s} x{c[0]} ({c[2]} free"
            + (f", {c[0] - c[1]} unhealthy" if c[0] != c[1] else "")
            + ")"
            for s, c in sorted(by_series.items())
        )
        or "none"
    )


def nodes_table(nodes: list[Node], now_ms: int) -> Table:
    table = Table(box=None, pad_edge=False)
    for column in ("NODE", "NAME", "FLEET", "SCHEDULING", "CONTROL", "LAST HEARTBEAT", "GPUS"):
        table.add_column(column, no_wrap=True)
    table.add_column("MEMBERS", no_wrap=True)
    for n in nodes:
        table.add_row(
            n.id,
            n.name or n.id,
            n.fleet,
            n.scheduling,
            control(n, now_ms),
            ago(n.last_heartbeat_ms, now_ms),
            _gpu_summary(n),
            str(len(n.members)),
        )
    return table


def _bytes(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n else "-"


def node_view(node: Node, now_ms: int) -> list[RenderableType]:
    inv = node.inventory
    scheduling = node.scheduling
    if node.scheduling_changed_at_ms:
        why = f": {node.scheduling_reason}" if node.scheduling_reason else ""
        scheduling += (
            f" (by {node.scheduling_changed_by or '-'} at {when(node.scheduling_changed_at_ms)}"
            f"{why})"
        )
    parts: list[RenderableType] = [
        pairs(
            [
                ("Node", node.id),
                ("Name", node.name or node.id),
                ("Fleet", node.fleet),
                ("Hostname", node.hostname or "-"),
                ("Scheduling", scheduling),
                ("Control", control(node, now_ms)),
                ("Dialed", node.dialed_address or "-"),
                ("Outputs", node.outputs_address or "- (serves no outputs to other Nodes)"),
                ("Last heartbeat", ago(node.last_heartbeat_ms, now_ms)),
                ("Enrolled", when(node.enrolled_at_ms)),
                ("Credential", credential(node, now_ms)),
                ("CPUs", str(inv.cpu_count or "-")),
                ("Memory", _bytes(inv.memory_bytes)),
                (
                    "GPU source",
                    f"{inv.gpu_source or 'none'} (driver {inv.driver_version or '-'}, "
                    f"CUDA {inv.cuda_version or '-'})",
                ),
            ]
        ),
        heading("GPUs"),
    ]
    gpus = Table()
    for column in ("INDEX", "UUID", "SERIES", "NAME", "MEMORY", "HEALTH", "HELD BY"):
        gpus.add_column(column)
    for g in inv.gpus:
        health = "healthy" if g.healthy else f"unhealthy: {g.health_reason or 'no reason given'}"
        gpus.add_row(
            str(g.index),
            g.uuid or "-",
            g.series,
            g.name or "-",
            _bytes(g.memory_bytes),
            Text(health),
            _holder(node, g.index) or "free",
        )
    if not inv.gpus:
        gpus.add_row("(no GPUs reported)", "", "", "", "", "")
    parts += [gpus, heading("Members")]
    members = Table()
    for column in ("RUN ID", "ATTEMPT", "MEMBER", "STATE", "GPUS", "OWNER"):
        members.add_column(column)
    for m in node.members:
        members.add_row(
            m.member.run_id,
            str(m.member.attempt),
            str(m.member.member_index),
            m.state,
            ",".join(str(g) for g in m.gpu_indexes) or "-",
            m.owner or "-",
        )
    if not node.members:
        members.add_row("(holds no members)", "", "", "", "", "")
    parts.append(members)
    return parts
