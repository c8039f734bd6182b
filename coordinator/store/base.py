"""What every part of the coordinator :class:`~tuneplane.coordinator.store.core.Store` builds
on: the writer of its decision log, and the errors its operations raise.

Rules:
- :class:`StoreBase` is the bottom layer of ``Store``'s mixins (``core.py`` composes them); it
  knows no table but ``decisions``.
- Every decision (admission, reservation, commit/abort, release, state change) appends a row to
  ``decisions`` through :meth:`StoreBase.log_decision`, in the same transaction as its effects;
  one about a Job marks that Job changed (:meth:`~.db.StoreDb.changed`, for its watchers).
- The errors are sentences for the caller, each mapped once to a gRPC status at the edge
  (:mod:`~tuneplane.coordinator.gateways.status`).
"""

from __future__ import annotations

import json
from typing import Any

from ..values.jobs import MemberKey
from .db import StoreDb
from .handle import Handle, StoreError


class NotFound(StoreError):
    """The thing named does not exist (gRPC NOT_FOUND)."""


class Conflict(StoreError):
    """The request contradicts what is recorded (gRPC FAILED_PRECONDITION)."""


class EnrollRefused(StoreError):
    """The join token cannot enroll a Node (gRPC PERMISSION_DENIED)."""


class StoreBase(StoreDb):
    """The base of the coordinator store's mixins: the decision log's writer."""

    async def log_decision(
        self,
        db: Handle,
        now: int,
        kind: str,
        detail: dict[str, Any],
        member: MemberKey | None = None,
        run_id: str | None = None,
        node_id: str | None = None,
    ) -> None:
        # A decision about a Job changes what GetJob shows of it: its watchers are woken.
        about = member.run_id if member else run_id
        if about is not None:
            self.changed(about)
        await db.execute(
            "INSERT INTO decisions (at_ms, kind, run_id, attempt, member_index, node_id, "
            "detail_json) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                now,
                kind,
                member.run_id if member else run_id,
                member.attempt if member else None,
                member.member_index if member else None,
                node_id,
                json.dumps(detail, sort_keys=True),
            ),
        )
