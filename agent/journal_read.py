"""Read the journal without the daemon: read-only, for ``tuneplane-node journal|status|doctor``.

Rules: the file is opened with a ``file:...?mode=ro`` URI (never ``immutable=1``, which would
ignore the daemon's WAL and show stale state), so reading works whether the daemon is stopped or
running, and never needs the coordinator. Nothing here writes.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

from .journal_records import (
    HEALTH_COLUMNS,
    MEMBER_COLUMNS,
    REPORT_COLUMNS,
    XID_COLUMNS,
    MemberKey,
    MemberRecord,
    PendingReport,
    health_from_row,
    member_from_row,
    report_from_row,
    xid_from_row,
)
from .xid_book import XidBook, meaning, utc_text


class JournalUnreadable(Exception):
    """The journal file is missing or cannot be read; ``str()`` names it and the fix."""


@contextmanager
def open_readonly(path: Path) -> Iterator[sqlite3.Connection]:
    if not path.exists():
        raise JournalUnreadable(
            f"There is no journal at {path}; start the agent once with `tuneplane-node run` or "
            "pass the right --state-dir."
        )
    uri = f"file:{quote(str(path.resolve()))}?mode=ro"
    try:
        db = sqlite3.connect(uri, uri=True, timeout=5.0)
        db.execute("PRAGMA busy_timeout = 5000")
        db.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.DatabaseError as exc:
        raise JournalUnreadable(f"The journal {path} cannot be read: {exc}.") from None
    try:
        yield db
    except sqlite3.DatabaseError as exc:
        raise JournalUnreadable(f"The journal {path} cannot be read: {exc}.") from None
    finally:
        db.close()


def integrity_problems(db: sqlite3.Connection) -> list[str]:
    rows = db.execute("PRAGMA integrity_check").fetchall()
    return [] if [tuple(r) for r in rows] == [("ok",)] else [str(r[0]) for r in rows]


def _version(db: sqlite3.Connection) -> int:
    return int(db.execute("PRAGMA user_version").fetchone()[0])


def _member_columns(db: sqlite3.Connection) -> str:
    """:data:`MEMBER_COLUMNS`, or what stands for them in a journal an older agent still runs
    on (an upgraded CLI reads it before the agent's restart migrates it; nothing here writes)."""
    return (
        MEMBER_COLUMNS
        if _version(db) >= 3
        else MEMBER_COLUMNS.replace("gpu_uuids", "'[]' AS gpu_uuids")
    )


def members(db: sqlite3.Connection) -> list[MemberRecord]:
    sql = f"SELECT {_member_columns(db)} FROM members ORDER BY created_at_ms"
    return [member_from_row(r) for r in db.execute(sql).fetchall()]


def member(db: sqlite3.Connection, key: MemberKey) -> MemberRecord | None:
    row = db.execute(
        f"SELECT {_member_columns(db)} FROM members WHERE member_key = ?", (str(key),)
    ).fetchone()
    return member_from_row(row) if row else None


def events(
    db: sqlite3.Connection,
    since_ms: int | None = None,
    key: MemberKey | None = None,
    *,
    kinds: Sequence[str] = (),
    node_only: bool = False,
) -> list[dict[str, Any]]:
    """Events oldest first; ``node_only``: those about the Node itself (``member_key`` NULL)."""
    sql = "SELECT id, at_ms, member_key, kind, from_state, to_state, reason, details FROM events"
    where: list[str] = []
    args: list[Any] = []
    if since_ms is not None:
        where.append("at_ms >= ?")
        args.append(since_ms)
    if key is not None:
        where.append("member_key = ?")
        args.append(str(key))
    if node_only:
        where.append("member_key IS NULL")
    if kinds:
        where.append(f"kind IN ({', '.join('?' for _ in kinds)})")
        args.extend(kinds)
    if where:
        sql += " WHERE " + " AND ".join(where)
    names = ("id", "at_ms", "member", "kind", "from_state", "to_state", "reason")
    return [
        dict(zip(names, r[:7], strict=True), details=json.loads(r[7]))
        for r in db.execute(sql + " ORDER BY id", args).fetchall()
    ]


def event_kinds(db: sqlite3.Connection) -> list[str]:
    """Every event kind this journal holds, sorted (to name the choices when a filter misses)."""
    return [str(r[0]) for r in db.execute("SELECT DISTINCT kind FROM events ORDER BY kind")]


def reservations(db: sqlite3.Connection) -> list[dict[str, Any]]:
    """GPU ownership joined with the owning member's state."""
    uuid = "g.gpu_uuid" if _version(db) >= 3 else "''"
    rows = db.execute(
        f"SELECT g.gpu_index, {uuid}, g.member_key, g.since_ms, m.state FROM gpu_ownership g "
        "JOIN members m ON m.member_key = g.member_key ORDER BY g.gpu_index"
    ).fetchall()
    return [
        {"gpu_index": r[0], "gpu_uuid": r[1], "member": r[2], "since_ms": r[3], "state": r[4]}
        for r in rows
    ]


def xid_book(db: sqlite3.Connection) -> XidBook:
    if _version(db) < 3:
        return XidBook()  # an older agent kept no XIDs in its journal
    xids = db.execute(f"SELECT {XID_COLUMNS} FROM gpu_xids ORDER BY id").fetchall()
    events = db.execute(f"SELECT {HEALTH_COLUMNS} FROM gpu_health_events ORDER BY id").fetchall()
    return XidBook.of(map(xid_from_row, xids), map(health_from_row, events))


def gpu_history(db: sqlite3.Connection) -> list[dict[str, Any]]:
    """XIDs and GPU health events (clears, recovery actions), oldest first, as one list."""
    book = xid_book(db)
    rows: list[dict[str, Any]] = [
        {
            "at_ms": x.at_ms,
            "at": utc_text(x.at_ms),
            "gpu_uuid": x.uuid or "(unidentified: every GPU)",
            "what": f"xid {x.xid}",
            "disables": not x.application,
            "detail": meaning(x.xid),
        }
        for x in book.xids
    ]
    rows += [
        {
            "at_ms": e.at_ms,
            "at": utc_text(e.at_ms),
            "gpu_uuid": e.uuid,
            "what": e.kind,
            "disables": False,
            "detail": f"by {e.actor}: {e.reason}",
        }
        for e in book.events
    ]
    return sorted(rows, key=lambda r: int(r["at_ms"]))


def disabled_gpus(db: sqlite3.Connection) -> list[dict[str, Any]]:
    """Every GPU UUID the journal's XIDs disable now, with why (unidentified XIDs as "")."""
    book = xid_book(db)
    # The journal knows a GPU by its XIDs, its health events and the members that held it.
    known = {x.uuid for x in book.xids} | {e.uuid for e in book.events}
    known |= {u for r in members(db) for u in r.gpu_uuids}
    named = sorted(known - {""})
    out = []
    for uuid in named:
        why = book.why_disabled(uuid)
        if why is not None:
            out.append({"gpu_uuid": uuid, "why": why})
    return out


def pending_reports(db: sqlite3.Connection) -> list[PendingReport]:
    # A journal not yet opened by an agent that gives journals an id has none: "".
    journal_id = meta(db).get("journal_id", "")
    # A journal older than output manifests (schema 4) has no manifest column: read it as "".
    names = {str(r[1]) for r in db.execute("PRAGMA table_info(pending_reports)").fetchall()}
    columns = REPORT_COLUMNS if "manifest" in names else REPORT_COLUMNS.replace(", manifest", "")
    rows = db.execute(f"SELECT {columns} FROM pending_reports ORDER BY report_seq")
    return [report_from_row(r, journal_id) for r in rows.fetchall()]


def credentials(db: sqlite3.Connection) -> list[dict[str, Any]]:
    rows = db.execute("SELECT name, created_at_ms, rotated_at_ms FROM credentials ORDER BY name")
    return [{"name": r[0], "created_at_ms": r[1], "rotated_at_ms": r[2]} for r in rows]


def meta(db: sqlite3.Connection) -> dict[str, str]:
    return {str(k): str(v) for k, v in db.execute("SELECT key, value FROM meta").fetchall()}


def member_json(record: MemberRecord) -> dict[str, Any]:
    return {
        "member": str(record.key),
        "run_id": record.key.run_id,
        "attempt": record.key.attempt,
        "member_index": record.key.member_index,
        "state": record.state.value,
        "created_at_ms": record.created_at_ms,
        "updated_at_ms": record.updated_at_ms,
        "member_count": record.member_count,
        "gpu_indexes": list(record.gpu_indexes),
        "gpu_uuids": list(record.gpu_uuids),
        "rendezvous": f"{record.master_addr}:{record.master_port}" if record.master_port else "",
        "member_dir": record.member_dir,
        "out_dir": record.out_dir,
        "grace_period_s": record.grace_period_s,
        "exit_code": record.exit.exit_code if record.exit else None,
        "signal": record.exit.signal if record.exit else None,
        "reason": record.reason,
    }


def report_json(report: PendingReport) -> dict[str, Any]:
    return {
        "report_seq": report.report_seq,
        "journal_id": report.journal_id,
        "member": str(report.key),
        "state": report.state.value,
        "at_ms": report.at_ms,
        "reason": report.reason,
        "exit_code": report.exit.exit_code if report.exit else None,
        "signal": report.exit.signal if report.exit else None,
        # An exit report's output manifest summary (files, bytes, sha256 or problem); else null.
        "output_manifest": json.loads(report.manifest) if report.manifest else None,
    }


def export(db: sqlite3.Connection) -> dict[str, Any]:
    """Everything the journal holds (never a credential's value: the journal has none)."""
    return {
        "meta": meta(db),
        "members": [member_json(r) for r in members(db)],
        "reservations": reservations(db),
        "pending_reports": [report_json(r) for r in pending_reports(db)],
        "credentials": credentials(db),
        "gpu_history": gpu_history(db),
        "events": events(db),
    }
