"""The console's JSON: values as the ``/api/v1`` answers carry them, one function per value.

Rules: a float that is not finite (NaN) is JSON null. Times are epoch milliseconds (0 or
null: not known), as the values hold them. A Node's connectivity and its scheduling state are
separate fields, never merged. Secrets never appear (the values carry none).
"""

from __future__ import annotations

import csv
import io
import math
from typing import Any

from ..values.decisions import DecisionRow
from ..values.fleet import Fleet, Node
from ..values.jobs import Attempt, Job, Member, StateChange
from ..values.lifecycle import CancelOutcome, LogPage, RetryOutcome
from ..values.metrics import Delivery, SeriesResult, TagSummary
from ..values.users import User

JsonObject = dict[str, Any]


def user_json(user: User) -> JsonObject:
    return {"name": user.name, "role": user.role}


def fleet_json(fleet: Fleet) -> JsonObject:
    return {
        "name": fleet.name,
        "kind": fleet.kind,
        "created_at_ms": fleet.created_at_ms,
        "nodes": fleet.nodes,
        "connected_nodes": fleet.connected_nodes,
        "schedulable_nodes": fleet.schedulable_nodes,
        "queued_jobs": fleet.queued_jobs,
        "active_jobs": fleet.active_jobs,
        "capacity": [
            {
                "series": c.series,
                "total": c.total,
                "healthy": c.healthy,
                "free": c.free,
                "in_use": c.in_use,
                "quota": c.quota,
            }
            for c in fleet.capacity
        ],
    }


def node_json(node: Node) -> JsonObject:
    """A Node with each GPU's health and the owner of the member holding it."""
    owners = {m.member: m.owner for m in node.members}
    gpus = []
    for gpu in node.inventory.gpus:
        held = node.held_by.get(gpu.index)
        gpus.append(
            {
                "index": gpu.index,
                "series": gpu.series,
                "name": gpu.name,
                "healthy": gpu.healthy,
                "health_reason": gpu.health_reason,
                "held_by": held.text if held is not None else "",
                "owner": owners.get(held, "") if held is not None else "",
            }
        )
    return {
        "id": node.id,
        "name": node.name,
        "fleet": node.fleet,
        "hostname": node.hostname,
        "connected": node.connected,
        "disconnected_since_ms": node.disconnected_since_ms,
        "last_heartbeat_ms": node.last_heartbeat_ms,
        "scheduling": node.scheduling,
        "scheduling_reason": node.scheduling_reason,
        "scheduling_changed_by": node.scheduling_changed_by,
        "scheduling_changed_at_ms": node.scheduling_changed_at_ms,
        "enrolled_at_ms": node.enrolled_at_ms,
        "credential_expires_at_ms": node.credential_expires_at_ms,
        "revoked_at_ms": node.revoked_at_ms,
        "gpus": gpus,
    }


def _history(history: tuple[StateChange, ...]) -> list[JsonObject]:
    return [{"state": h.state, "at_ms": h.at_ms, "reason": h.reason} for h in history]


def _member(member: Member) -> JsonObject:
    return {
        "index": member.index,
        "node_id": member.node_id,
        "node_name": member.node_name,
        "state": member.state,
        "gpu_indexes": list(member.gpu_indexes),
        "exit_code": member.exit_code if member.has_exit else None,
        "signal": member.signal if member.has_exit and member.signal else None,
        "ended_at_ms": member.ended_at_ms,
        "history": _history(member.history),
    }


def _attempt(attempt: Attempt) -> JsonObject:
    return {
        "number": attempt.number,
        "state": attempt.state,
        "created_at_ms": attempt.created_at_ms,
        "members": [_member(m) for m in attempt.members],
    }


def job_json(job: Job) -> JsonObject:
    """A Job; its history and attempts are empty in a list, filled for one Job."""
    return {
        "run_id": job.run_id,
        "project": job.project,
        "experiment": job.experiment,
        "owner": job.owner,
        "state": job.state,
        "state_reason": job.state_reason,
        "fleet": job.fleet,
        "profile": job.profile,
        "method_id": job.method_id,
        "runtime_id": job.runtime_id,
        "init_from": job.init_from,
        "created_at_ms": job.created_at_ms,
        "history": _history(job.history),
        "attempts": [_attempt(a) for a in job.attempts],
    }


def delivery_json(delivery: Delivery) -> JsonObject:
    return {
        "attempt": delivery.member.attempt,
        "member_index": delivery.member.member_index,
        "points_stored": delivery.points_stored,
        "spool_points": delivery.spool_points,
        "backpressure": delivery.backpressure,
        "drained": delivery.drained,
        "last_point_wall_ms": delivery.last_point_wall_ms,
        "last_contact_ms": delivery.last_contact_ms,
        "warnings": delivery.warnings,
        "data_loss_warnings": delivery.data_loss_warnings,
    }


def cancel_json(outcome: CancelOutcome) -> JsonObject:
    return {"outcome": outcome.outcome, "job": job_json(outcome.job)}


def retry_json(outcome: RetryOutcome) -> JsonObject:
    return {"attempt": outcome.attempt, "job": job_json(outcome.job)}


def decision_json(row: DecisionRow) -> JsonObject:
    return {
        "id": row.id,
        "at_ms": row.at_ms,
        "kind": row.kind,
        "attempt": row.attempt,
        "member_index": row.member_index,
        "node_id": row.node_id,
        "detail": dict(row.detail),
    }


def log_page_json(page: LogPage) -> JsonObject:
    """A bounded log read: its pieces as text (bytes that are not UTF-8 replaced), each with
    its byte offset and the bytes dropped before it, and the offset to read on from."""
    return {
        "attempt": page.attempt,
        "member_index": page.member_index,
        "stream": page.stream,
        "pieces": [
            {
                "offset": p.offset,
                "dropped_before": p.dropped_before,
                "text": p.data.decode("utf-8", "replace"),
            }
            for p in page.pieces
        ],
        "next_offset": page.next_offset,
        "complete": page.complete,
        "dropped_bytes": page.dropped_bytes,
        "member_state": page.member_state,
    }


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def tags_json(run_id: str, attempt: int, tags: list[TagSummary]) -> JsonObject:
    return {
        "run_id": run_id,
        "attempt": attempt,
        "tags": [
            {
                "tag": t.tag,
                "points": t.points,
                "last_step": t.last_step,
                "last_value": _finite(t.last_value),
                "series": t.series,
            }
            for t in tags
        ],
    }


def series_json(run_id: str, result: SeriesResult, steps: tuple[int, int] | None) -> JsonObject:
    """A bounded series, by column (what a chart draws from): per bucket its first and last
    step, point count, min, max and last (the value at its last step)."""
    b = result.buckets
    return {
        "run_id": run_id,
        "tag": result.tag,
        "attempt": result.attempt,
        "total_points": result.total_points,
        "downsampled": result.downsampled,
        "series": result.series,
        "from": None if steps is None else steps[0],
        "to": None if steps is None else steps[1],
        "buckets": len(b),
        "first_step": [x.first_step for x in b],
        "last_step": [x.last_step for x in b],
        "count": [x.count for x in b],
        "min": [_finite(x.min) for x in b],
        "max": [_finite(x.max) for x in b],
        "last": [_finite(x.last) for x in b],
    }


def series_csv(result: SeriesResult) -> str:
    """The same buckets as CSV, one row each; a value that is not finite is an empty cell."""
    out = io.StringIO()
    rows = csv.writer(out, lineterminator="\n")
    rows.writerow(["first_step", "last_step", "count", "min", "max", "last"])
    for x in result.buckets:
        rows.writerow(
            [
                x.first_step,
                x.last_step,
                x.count,
                *("" if not math.isfinite(v) else repr(v) for v in (x.min, x.max, x.last)),
            ]
        )
    return out.getvalue()
