"""The store's side of the coordinator's Prometheus gauges: a few counts, read together.

Rules:
- Every read is bounded by what is live, never by history: each Job state that is not terminal
  is one range of the ``jobs_by_state`` index, the oldest queued Job is its first entry, and
  the Nodes are one row each. Ended Jobs are not counted (their number only grows).
- Read by :mod:`tuneplane.coordinator.server.metrics_export` every few seconds, never per scrape.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from .. import lifecycle as lc
from ..placement import CORDONED
from .core import Store
from .handle import Handle

#: The Job states counted, in the order the lifecycle names them (``unknown`` among them).
LIVE_JOB_STATES = (
    lc.QUEUED,
    lc.RESERVED,
    lc.PREPARING,
    lc.STARTING,
    lc.RUNNING,
    lc.UNKNOWN,
    lc.CANCELLING,
)
#: A Node's connectivity as the gauges name it.
CONNECTIVITY = ("connected", "disconnected", "revoked")


@attrs.frozen
class StoreGauges:
    """What the store said at ``read_at_ms``."""

    read_at_ms: int
    jobs: Mapping[str, int]
    # When the oldest queued Job was admitted (epoch ms); None: the queue is empty.
    oldest_queued_ms: int | None
    nodes: Mapping[str, int]
    # How long the longest-disconnected Node that should be working (not revoked, not cordoned)
    # has been away at ``read_at_ms``, in ms; 0 when every such Node is connected.
    longest_disconnected_ms: int

    @property
    def queue_length(self) -> int:
        return self.jobs.get(lc.QUEUED, 0)


async def _one(db: Handle, sql: str, *args: Any) -> Any:
    """The one row an aggregate query returns."""
    rows = list(await db.execute_fetchall(sql, args))
    return rows[0]


async def read_gauges(store: Store, now: int) -> StoreGauges:
    """The counts the gauges show, read from ``store`` at ``now`` (epoch ms)."""
    db = store.reader
    jobs: dict[str, int] = {}
    for state in LIVE_JOB_STATES:
        (count,) = await _one(db, "SELECT COUNT(*) FROM jobs WHERE state = ?", state)
        jobs[state] = int(count)
    (oldest,) = await _one(db, "SELECT MIN(created_at_ms) FROM jobs WHERE state = ?", lc.QUEUED)
    nodes = dict.fromkeys(CONNECTIVITY, 0)
    longest = 0
    for connected, revoked, scheduling, since, enrolled in await db.execute_fetchall(
        "SELECT connected, revoked_at_ms IS NOT NULL, scheduling, disconnected_since_ms, "
        "enrolled_at_ms FROM nodes"
    ):
        if revoked:
            nodes["revoked"] += 1
        elif connected:
            nodes["connected"] += 1
        else:
            nodes["disconnected"] += 1
            if scheduling != CORDONED:
                away_since = int(since if since is not None else enrolled)
                longest = max(longest, now - away_since)
    return StoreGauges(
        read_at_ms=now,
        jobs=jobs,
        oldest_queued_ms=None if oldest is None else int(oldest),
        nodes=nodes,
        longest_disconnected_ms=max(longest, 0),
    )
