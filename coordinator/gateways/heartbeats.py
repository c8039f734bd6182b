"""Node heartbeats: acknowledged from memory, written to the store in one batch per interval.

Rules:
- A heartbeat is not a decision. The gateway records it in a :class:`HeartbeatBook` and acks at
  once; a :class:`HeartbeatFlusher` writes every time recorded since its last flush in one
  transaction per interval, and once more at shutdown, so a stored time is at most one flush
  interval old and the live value is always in the book.
- Stored times only move forward (the store keeps the larger), so a late flush never rewinds a
  time a Hello wrote meanwhile; a flush that fails puts its times back for the next one.
- Connectivity and inventory changes are decisions: the gateway writes them at once, not here.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import anyio
import attrs

from ..store.core import Store, StoreError
from .collector_credentials import CollectorCredentials

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class HeartbeatBook:
    """Each Node's latest heartbeat time (epoch ms), and which of them are not yet stored."""

    _latest: dict[str, int] = attrs.field(factory=dict, alias="latest")
    _unwritten: dict[str, int] = attrs.field(factory=dict, alias="unwritten")

    def record(self, node_id: str, at_ms: int) -> None:
        """Note a heartbeat heard at ``at_ms``; an older time than the one held is ignored."""
        if at_ms > self._latest.get(node_id, 0):
            self._latest[node_id] = at_ms
            self._unwritten[node_id] = at_ms

    def last(self, node_id: str) -> int:
        """The latest heartbeat time this process heard from the Node; 0 when none."""
        return self._latest.get(node_id, 0)

    def take(self) -> dict[str, int]:
        """The times not yet stored (node id -> ms); the book forgets they were unwritten."""
        batch, self._unwritten = self._unwritten, {}
        return batch

    def put_back(self, batch: Mapping[str, int]) -> None:
        """Undo :meth:`take` for a batch that was not stored; a newer time meanwhile wins."""
        for node_id, at_ms in batch.items():
            if at_ms > self._unwritten.get(node_id, 0):
                self._unwritten[node_id] = at_ms

    def pending(self) -> int:
        return len(self._unwritten)


class HeartbeatFlusher:
    """Writes a :class:`HeartbeatBook` to the store (and renews collector credentials)."""

    def __init__(
        self,
        book: HeartbeatBook,
        store: Store,
        interval_s: float,
        collectors: CollectorCredentials | None = None,
    ) -> None:
        self._book = book
        self._store = store
        self._interval = interval_s
        self._collectors = collectors

    async def run(self) -> None:
        """Flush every interval until cancelled. The owner calls :meth:`flush` once more after
        the last session closed, so no heartbeat heard before shutdown is lost."""
        while True:
            await anyio.sleep(self._interval)
            try:
                await self.flush()
            except (StoreError, OSError) as exc:
                # The times stay in the book; the next interval tries again.
                log.warning(
                    "heartbeat flush failed; retrying next interval pending=%d error=%s",
                    self._book.pending(),
                    exc,
                )

    async def flush(self) -> int:
        """Store every unwritten time in one transaction; returns how many Nodes were written."""
        batch = self._book.take()
        if not batch:
            return 0
        try:
            await self._store.node_heartbeats(batch)
            if self._collectors is not None:
                await self._collectors.heartbeats(batch)
        except BaseException:
            self._book.put_back(batch)
            raise
        log.debug("heartbeats stored nodes=%d", len(batch))
        return len(batch)
