"""What a scheduling pass reads of the store (connected Nodes' free GPUs, GPUs in use per
pool, the queue) and the queue status it writes back (why each queued Job waits).

Rules:
- These run on the coordinator :class:`~tuneplane.coordinator.store.core.Store`: each write is
  one store transaction (one writer at a time), shielded from the caller's deadline. Reads
  never write.
- A wait reason is written only where it changed, and only for a Job still queued.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

from .. import lifecycle as lc
from ..placement import Request
from ..queue_plan import NodeState, PoolKey, QueuedRequest
from .core import Store
from .fleet_rows import fetch_rows, parsed_inventory, reservations_by_node


async def node_states(
    store: Store, is_connected: Callable[[str], bool], fleets: Sequence[str]
) -> list[NodeState]:
    """The Nodes of ``fleets`` with their free healthy GPUs per Series; connectivity from the
    live sessions. Only connected Nodes are read: no other can take a member now."""
    if not fleets:
        return []
    held = await reservations_by_node(store)
    states = []
    marks = ", ".join("?" for _ in fleets)
    for node_id, fleet, inv, scheduling in await fetch_rows(
        store,
        f"SELECT id, fleet, inventory_json, scheduling FROM nodes WHERE fleet IN ({marks}) "
        "AND connected = 1 ORDER BY id",
        fleets,
    ):
        taken = held.get(str(node_id), {})
        free: dict[str, list[int]] = {}
        for g in parsed_inventory(str(inv)).gpus:
            if g.healthy and g.index not in taken:
                free.setdefault(g.series, []).append(g.index)
        states.append(
            NodeState(
                node_id=str(node_id),
                fleet=str(fleet),
                connected=is_connected(str(node_id)),
                scheduling=str(scheduling),
                free={s: tuple(sorted(ix)) for s, ix in free.items()},
            )
        )
    return states


async def gpus_in_use(store: Store) -> dict[PoolKey, int]:
    """Reserved GPUs per (Fleet, Series): what quotas count."""
    return {
        (str(fleet), str(series)): int(count)
        for fleet, series, count in await fetch_rows(
            store,
            "SELECT j.fleet, j.series, COUNT(*) FROM reservations r JOIN jobs j "
            "ON j.run_id = r.run_id GROUP BY j.fleet, j.series",
        )
    }


async def queue_mark(store: Store) -> tuple[int, int]:
    """How many Jobs are queued and the newest one's admission time: one range of the
    ``jobs_by_state`` index, so a pass can tell that the queue changed without reading it (a Job
    queued or gone that no one told the scheduler about moves one or the other)."""
    ((count, newest),) = await fetch_rows(
        store,
        "SELECT COUNT(*), COALESCE(MAX(created_at_ms), 0) FROM jobs WHERE state = ?",
        (lc.QUEUED,),
    )
    return int(count), int(newest)


#: Run ids named in one read of the queue (well under SQLite's limit on bound values).
RUN_IDS_PER_READ = 500


#: Jobs of a Slurm Fleet are Slurm's to queue (``server/slurm_executor.py``), never placed here.
_ON_NODES = "AND fleet NOT IN (SELECT fleet FROM slurm_fleets)"


async def queued_requests(
    store: Store, only: Collection[str] | None = None
) -> tuple[list[QueuedRequest], dict[str, str], int]:
    """The queue as a pass reads it, oldest first, each queued Job's recorded reason, and the
    newest admission time among them (0 for none); with ``only``, just those of its Jobs (each
    read by its key, so the queue's length costs nothing).

    One read of ``jobs`` alone (by its state index): the resolved JobSpecs are read only for the
    Jobs that launch (:meth:`Store.queued_job`). Equal shapes share one :class:`Request`.
    """
    columns = "run_id, fleet, series, gpus, members_wanted, gpus_per_member, state_reason"
    if only is None:
        rows = await fetch_rows(
            store,
            f"SELECT {columns}, created_at_ms FROM jobs WHERE state = ? {_ON_NODES} "
            "ORDER BY created_at_ms, run_id",
            (lc.QUEUED,),
        )
    else:
        found = []
        wanted = sorted(only)
        for start in range(0, len(wanted), RUN_IDS_PER_READ):
            part = wanted[start : start + RUN_IDS_PER_READ]
            marks = ", ".join("?" for _ in part)
            found += await fetch_rows(
                store,
                f"SELECT {columns}, created_at_ms FROM jobs WHERE state = ? {_ON_NODES} "
                f"AND run_id IN ({marks})",
                (lc.QUEUED, *part),
            )
        # In queue order, as the whole queue's read gives it: admission time, then run id.
        rows = sorted((tuple(row) for row in found), key=lambda row: (row[-1], row[0]))
    shapes: dict[tuple[int, int | None, int | None], Request] = {}
    queue: list[QueuedRequest] = []
    reasons: dict[str, str] = {}
    newest = 0
    for run_id, fleet, series, gpus, members, per_member, reason, created in rows:
        shape = (int(gpus), members, per_member)
        request = shapes.get(shape)
        if request is None:
            request = shapes[shape] = Request(*shape)
        queue.append(QueuedRequest(str(run_id), str(fleet), str(series), request))
        reasons[str(run_id)] = str(reason)
        newest = max(newest, int(created))
    return queue, reasons, newest


async def set_wait_reasons(
    store: Store, waiting: Mapping[str, str], recorded: Mapping[str, str], now: int
) -> None:
    """Record why each queued Job waits, writing only the reasons that differ from ``recorded``
    (what :func:`queued_requests` read at the start of the pass). A Job that left the queue
    meanwhile is not touched: the update names its state."""
    changed = {r: why for r, why in waiting.items() if r in recorded and recorded[r] != why}
    if not changed:
        return

    async def work() -> None:
        async with store.transaction() as db:
            await db.executemany(
                "UPDATE jobs SET state_reason = ?, updated_at_ms = ? "
                "WHERE run_id = ? AND state = ?",
                [(why, now, run_id, lc.QUEUED) for run_id, why in sorted(changed.items())],
            )
            for run_id in changed:
                store.changed(run_id)

    await store.shielded(work)
