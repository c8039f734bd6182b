"""The lease fence on a leading coordinator's write transactions (PostgreSQL only).

Rules (the lease's are :mod:`tuneplane.coordinator.leadership`'s and :mod:`.lease`'s):
- Every write transaction of a leader first takes its store's write lock and then runs
  :data:`FENCE_SQL` with its term: it holds the lease row shared until the transaction ends,
  so a takeover (which locks the row for update) waits for writes in flight, and a write after
  a takeover finds another term, tells its coordinator and fails with :class:`Fenced`, keeping
  nothing.
- The same first statement sets how long the transaction may sit idle before the database ends
  it: the lease's time (:func:`stall_limit`). A leader paused mid-write (SIGSTOP, a frozen VM,
  swap) would otherwise hold the lease row and the write lock while it sleeps, and hold off the
  takeover past the lease.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from .handle import Fenced

#: The schema of the leader lease (:mod:`.lease`), shared by every store in the database.
LEASE_SCHEMA = "tuneplane_ha"
FENCE_SQL = f"SELECT term FROM {LEASE_SCHEMA}.lease WHERE id = 1 AND term = $1 FOR SHARE"
STALL_FLOOR_MS = 1000
_BEGIN_SQL = (
    "SELECT set_config('idle_in_transaction_session_timeout', $2, true), pg_advisory_xact_lock($1)"
)


def stall_limit(ttl_s: float) -> str:
    """``idle_in_transaction_session_timeout`` for a transaction of a lease holder (a leader's
    write, a standby's take): the lease's time, and at least :data:`STALL_FLOOR_MS` (a
    round trip must never count as a stall). The database ends the session of a holder
    stalled that long mid-transaction, so the next leader takes over when the lease expires
    instead of waiting on it. A leader stalled that long has passed its own step-down deadline
    (:func:`~tuneplane.coordinator.leadership.must_step_down_at`): nothing it could still
    commit is lost."""
    return f"{max(STALL_FLOOR_MS, round(ttl_s * 1000))}ms"


@attrs.frozen
class LeaseFence:
    """The term a leader's writes must still find, and what to call when one does not."""

    term: int
    on_fenced: Callable[[], None]
    ttl_s: float

    async def begin(self, conn: Any, lock_key: int) -> None:
        """A write transaction's first statements, on its asyncpg connection: the write lock
        ``lock_key``, the stall limit, then the fence."""
        await conn.execute(_BEGIN_SQL, lock_key, stall_limit(self.ttl_s))
        if await conn.fetchval(FENCE_SQL, self.term) is not None:
            return
        self.on_fenced()
        raise Fenced(
            f"this coordinator's lease (term {self.term}) was taken over by another "
            "coordinator; the write was refused and nothing of it kept. This coordinator stops "
            "acting and goes back to standby."
        )
