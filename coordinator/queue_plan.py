"""One scheduling pass over the whole queue, as a pure function: which Jobs launch, which wait, why.

Rules:
- Pure: takes the queue (oldest first), every Node's state, the GPUs in use and the quotas;
  returns launches and wait reasons. No clock, no store, no I/O, so a pass over 10,000 Jobs and
  1,000 Nodes is a benchmarkable function call.
- Jobs are tried in queue order; a Job that cannot start now waits and a later, smaller Job may
  still start (backfill). Within a pass free GPUs only shrink and usage only grows, so a request
  that failed once fails again and is not recomputed.
- A quota caps the GPUs of one Series that Jobs hold at once in one Fleet; a Job that would go
  over it waits with the reason ``waiting: quota <series> <in use>/<limit> in use``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from .placement import SCHEDULABLE, NodeOffer, Placement, Request, place

# (fleet, series)
PoolKey = tuple[str, str]


@attrs.frozen
class NodeState:
    """A Node as the pass sees it: free healthy GPU indexes per Series (reservations removed)."""

    node_id: str
    fleet: str
    connected: bool
    scheduling: str
    free: Mapping[str, tuple[int, ...]]


@attrs.frozen
class QueuedRequest:
    run_id: str
    fleet: str
    series: str
    request: Request


@attrs.frozen
class Launch:
    run_id: str
    placement: Placement


@attrs.frozen
class PassPlan:
    launches: tuple[Launch, ...]
    # run id -> why it still waits, for every queued Job that does not launch in this pass.
    waiting: Mapping[str, str]


def quota_reason(series: str, in_use: int, limit: int) -> str:
    return f"waiting: quota {series} {in_use}/{limit} in use"


def plan_pass(
    queue: Sequence[QueuedRequest],
    nodes: Sequence[NodeState],
    in_use: Mapping[PoolKey, int],
    quotas: Mapping[PoolKey, int],
) -> PassPlan:
    """Decide this pass: launch what fits in queue order, and say why everything else waits."""
    # Per pool, the free GPUs of every connected, schedulable Node (node id -> indexes).
    pools: dict[PoolKey, dict[str, tuple[int, ...]]] = {}
    for node in nodes:
        if not node.connected or node.scheduling != SCHEDULABLE:
            continue
        for series, indexes in node.free.items():
            pools.setdefault((node.fleet, series), {})[node.node_id] = indexes
    used: dict[PoolKey, int] = dict(in_use)
    failed: dict[tuple[PoolKey, Request], str] = {}
    launches: list[Launch] = []
    waiting: dict[str, str] = {}
    for job in queue:
        key: PoolKey = (job.fleet, job.series)
        limit = quotas.get(key)
        now_used = used.get(key, 0)
        if limit is not None and job.request.gpus and now_used + job.request.gpus > limit:
            waiting[job.run_id] = quota_reason(job.series, now_used, limit)
            continue
        memo = (key, job.request)
        if memo in failed:
            waiting[job.run_id] = failed[memo]
            continue
        free = pools.get(key, {})
        placement = place(job.request, [NodeOffer(n, f) for n, f in free.items()])
        if placement is None:
            total = sum(len(f) for f in free.values())
            waiting[job.run_id] = failed[memo] = (
                f"waiting: needs {job.request.gpus} {job.series} GPU(s) as "
                f"{_shape(job.request)}; {total} free on {len(free)} schedulable Node(s) of "
                f"Fleet {job.fleet}"
            )
            continue
        for member in placement.members:
            taken = set(member.gpu_indexes)
            free[member.node_id] = tuple(g for g in free[member.node_id] if g not in taken)
        used[key] = now_used + job.request.gpus
        launches.append(Launch(job.run_id, placement))
    return PassPlan(tuple(launches), waiting)


def _shape(request: Request) -> str:
    if request.members is not None:
        return f"{request.members} member(s)"
    if request.gpus_per_member is not None:
        return f"{request.gpus_per_member} per member"
    return "any split"


__all__ = [
    "SCHEDULABLE",
    "Launch",
    "NodeState",
    "PassPlan",
    "PoolKey",
    "QueuedRequest",
    "plan_pass",
    "quota_reason",
]
