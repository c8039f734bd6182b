"""Who may read a Job: its owner, the users its project shares it with, and admins.

Rules:
- Pure: :func:`may_read` decides from the Job's :class:`JobAccess` and the caller; the SQL that
  finds the owner and the share list is in :mod:`~tuneplane.coordinator.store.access`.
- Reading a Job is everything it shows: state, history and attempts (GetJob, ListJobs), member
  logs (GetLogs), metrics and their delivery (ListMetrics, QuerySeries, GetDelivery). Changing
  it (cancel, retry) stays with its owner and admins (:mod:`store_lifecycle`).
- The share list is the JobSpec's ``share_with``, which ``tp`` fills from the project's
  ``tuneplane.yaml``. It is stored with the Job in its immutable preview, under the Job's
  digest. Only the Job's owner could have written it.
"""

from __future__ import annotations

import attrs

from .auth import PermissionDenied
from .values.users import User


@attrs.frozen
class JobAccess:
    """What decides who may read one Job."""

    run_id: str
    owner: str
    share_with: tuple[str, ...] = ()


def may_read(job: JobAccess, user: User) -> bool:
    """True when ``user`` may read ``job``: its owner, a user it is shared with, or an admin."""
    return user.is_admin or user.name == job.owner or user.name in job.share_with


def may_change(owner: str, who: str, is_admin: bool) -> bool:
    """True when ``who`` may cancel or retry a Job ``owner`` owns: its owner or an admin (the
    store decides it in the change's own transaction; the console shows its buttons by it)."""
    return who == owner or is_admin


def check_read(job: JobAccess, user: User, what: str) -> None:
    """:class:`PermissionDenied` with a sentence unless ``user`` may read ``job``'s ``what``."""
    if not may_read(job, user):
        raise PermissionDenied(
            f"the Job {job.run_id} belongs to {job.owner}, and its project does not share it "
            f"with {user.name}, so you may not read its {what}. Ask {job.owner} to add you to "
            "share_with in the project's tuneplane.yaml (it applies to Jobs submitted after), "
            "or ask an admin."
        )
