"""Whose journal is this: an enrolled Node runs only on its own, non-empty journal.

Rules: enrolment stamps the journal with the Node id. A missing journal is created fresh and
stamped (the documented recovery after moving a damaged one aside); an existing journal that is
empty, unstamped or stamped by another Node is refused as :class:`JournalCorrupt` before anything
is written to it, because running on it would forget members that may still hold GPUs.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import trio

from .journal import Journal
from .journal_records import JournalCorrupt

log = logging.getLogger(__name__)

NODE_ID_KEY = "node_id"


def owner_problem(path: Path, stamped: str | None, node_id: str) -> str | None:
    """Why the journal at ``path`` stamped ``stamped`` is not Node ``node_id``'s, or None."""
    if stamped == node_id:
        return None
    if stamped is None:
        return (
            f"The journal {path} holds no Node id: it is not the journal this Node was enrolled "
            f"with (Node {node_id}), so the members and GPU reservations it held are unknown."
        )
    return (
        f"The journal {path} belongs to Node {stamped}, not to this Node ({node_id}); it was "
        "copied from another machine, so it says nothing true about this one."
    )


def stamped_node_id(db: sqlite3.Connection) -> str | None:
    """The Node id a (read-only) journal connection was stamped with; None if it has none."""
    has_meta = db.execute(
        "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'meta'"
    ).fetchone()[0]
    if not has_meta:
        return None
    row = db.execute("SELECT value FROM meta WHERE key = ?", (NODE_ID_KEY,)).fetchone()
    return str(row[0]) if row else None


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


async def open_node_journal(path: Path, node_id: str, at_ms: int) -> Journal:
    """Open Node ``node_id``'s journal at ``path``, creating and stamping it when missing.

    Raises :class:`JournalCorrupt` (the caller enters safe mode) when the file is empty, fails
    its integrity check, or is not stamped with ``node_id``.
    """
    size = await trio.to_thread.run_sync(_size, path)
    existed = size is not None
    if size == 0:
        raise JournalCorrupt(
            f"The journal {path} is empty: the members and GPU reservations it held are lost."
        )
    journal = await Journal.open(path)
    stamped = await journal.get_meta(NODE_ID_KEY)
    if stamped is None and not existed:
        await journal.set_meta(NODE_ID_KEY, node_id)
        await journal.node_event(at_ms, "journal-created", node_id=node_id)
        log.warning("journal created fresh path=%s node_id=%s; it holds no members", path, node_id)
        return journal
    problem = owner_problem(path, stamped, node_id)
    if problem is not None:
        await journal.close()
        raise JournalCorrupt(problem)
    return journal
