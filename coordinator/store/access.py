"""The store reads behind Job access: a Job's owner and share list, and the Jobs a user may read.

Rules:
- Reads only, on the coordinator :class:`~tuneplane.coordinator.store.core.Store`. The decision
  itself is :func:`~tuneplane.coordinator.job_access.may_read`, applied here to every row
  before it is returned, so a query can never return more than the rule allows.
- The share list lives in the Job's preview (``previews.resolved_json``, the JobSpec the
  coordinator resolved and the Job's digest covers); nothing copies it elsewhere.
"""

from __future__ import annotations

import json
from typing import Any

from ..job_access import JobAccess, may_read
from ..values.jobs import Job
from ..values.users import User
from .core import NotFound, Store
from .handle import first_row

_ACCESS_SQL = (
    "SELECT j.run_id, j.owner, p.resolved_json FROM jobs j JOIN previews p ON p.id = j.preview_id"
)


def _access(row: Any) -> JobAccess:
    return JobAccess(str(row[0]), str(row[1]), share_list(str(row[2])))


def share_list(resolved_json: str) -> tuple[str, ...]:
    """The ``share_with`` names of a stored JobSpec; none when it has none or cannot be read."""
    try:
        names = json.loads(resolved_json).get("share_with", [])
    except (ValueError, AttributeError):
        return ()
    if not isinstance(names, list):
        return ()
    return tuple(n for n in names if isinstance(n, str))


async def job_access(store: Store, run_id: str) -> JobAccess:
    """Who owns ``run_id`` and who it is shared with; :class:`NotFound` if there is no such Job."""
    row = await first_row(store.reader, f"{_ACCESS_SQL} WHERE j.run_id = ?", (run_id,))
    if row is None:
        raise NotFound(f"there is no Job with run id {run_id!r}. Check it with `tp job ls`.")
    return _access(row)


async def readable_jobs(
    store: Store,
    user: User,
    project: str,
    state: str,
    mine: bool,
    limit: int,
    owner: str = "",
) -> list[Job]:
    """The newest ``limit`` Jobs ``user`` may read (only their own with ``mine``), filtered by
    ``project``, ``state`` and ``owner`` (the console's owner filter) when set."""
    if mine:
        if owner and owner != user.name:
            return []
        owner = user.name
    if user.is_admin or owner == user.name:
        return await store.list_jobs(project=project, state=state, owner=owner, limit=limit)
    # Candidates: the user's own Jobs and those whose JobSpec mentions the name as a string.
    # The LIKE only narrows the scan; may_read decides, so a name that appears elsewhere in a
    # JobSpec (an env value, say) shows nothing.
    clauses = ["(j.owner = ? OR p.resolved_json LIKE ? ESCAPE '\\')"]
    args: list[Any] = [user.name, f'%"{_like_escaped(user.name)}"%']
    if project:
        clauses.append("j.project = ?")
        args.append(project)
    if state:
        clauses.append("j.state = ?")
        args.append(state)
    if owner:
        clauses.append("j.owner = ?")
        args.append(owner)
    sql = (
        f"{_ACCESS_SQL} WHERE {' AND '.join(clauses)} "
        "ORDER BY j.created_at_ms DESC, j.run_id LIMIT ? OFFSET ?"
    )
    found: list[str] = []
    offset = 0
    page = max(limit, 100)
    while len(found) < limit:
        rows = list(await store.reader.execute_fetchall(sql, (*args, page, offset)))
        for row in rows:
            if may_read(_access(row), user):
                found.append(str(row[0]))
                if len(found) == limit:
                    break
        if len(rows) < page:
            break
        offset += page
    return await store.job_views(found, full=False)


def _like_escaped(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
