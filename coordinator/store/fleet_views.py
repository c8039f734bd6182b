"""The store's views of Fleets and Nodes: a Node with its members and reservations, a Fleet
with its capacity per Series, a Node named by id or name, and what a Derivation's Preview
needs of the Node that holds its source.

Rules:
- These run on the coordinator :class:`~tuneplane.coordinator.store.core.Store`, outside any
  transaction. Reads never write.
- A Node "holds" a member until that member's last known state is terminal (exited, aborted,
  lost).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from .. import lifecycle as lc
from ..derivation import Holder
from ..placement import SCHEDULABLE
from ..queue_plan import PoolKey
from ..values.fleet import Fleet, Node, NodeMember, SeriesCapacity
from ..values.jobs import MemberKey
from ..values.orders import OutputsService
from .core import Conflict, NotFound, Store
from .fleet_rows import (
    LIVE_MEMBER,
    TERMINAL_STATES,
    fetch_rows,
    parsed_inventory,
    reservations_by_node,
)
from .node_scheduling import SCHEDULING_KINDS

log = logging.getLogger(__name__)


async def _node_rows(store: Store, fleet: str, node_id: str) -> list[Any]:
    clauses, args = [], []
    if fleet:
        clauses.append("fleet = ?")
        args.append(fleet)
    if node_id:
        clauses.append("id = ?")
        args.append(node_id)
    where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
    return await fetch_rows(
        store,
        "SELECT id, fleet, hostname, inventory_json, scheduling, connected, last_heartbeat_ms, "
        "disconnected_since_ms, enrolled_at_ms, credential_issued_at_ms, "
        "credential_expires_at_ms, revoked_at_ms, name, dialed_address, outputs_address "
        f"FROM nodes {where} "
        "ORDER BY fleet, id",
        args,
    )


async def node_views(store: Store, fleet: str = "", node_id: str = "") -> list[Node]:
    """Every Node (of ``fleet`` when given; only ``node_id`` when given), by Fleet then id."""
    rows = await _node_rows(store, fleet, node_id)
    if not rows:
        return []
    held = await reservations_by_node(store)
    members: dict[str, list[NodeMember]] = {}
    for nid, run_id, attempt, index, state, gpus, owner in await fetch_rows(
        store,
        "SELECT m.node_id, m.run_id, m.attempt, m.member_index, m.state, m.gpu_indexes_json, "
        f"j.owner FROM members m JOIN jobs j ON j.run_id = m.run_id WHERE m.{LIVE_MEMBER} "
        "ORDER BY m.run_id, m.attempt, m.member_index",
        TERMINAL_STATES,
    ):
        members.setdefault(str(nid), []).append(
            NodeMember(
                MemberKey(str(run_id), int(attempt), int(index)),
                str(state),
                tuple(json.loads(gpus)),
                str(owner),
            )
        )
    marks = ", ".join("?" for _ in SCHEDULING_KINDS)
    changes: dict[str, tuple[int, dict[str, Any]]] = {}
    for nid, at_ms, detail in await fetch_rows(
        store,
        f"SELECT node_id, at_ms, detail_json FROM decisions WHERE id IN (SELECT MAX(id) FROM "
        f"decisions WHERE kind IN ({marks}) GROUP BY node_id)",
        SCHEDULING_KINDS,
    ):
        changes[str(nid)] = (int(at_ms), json.loads(detail))
    views = []
    for r in rows:
        nid = str(r[0])
        at_ms, detail = changes.get(nid, (0, {}))
        views.append(
            Node(
                id=nid,
                fleet=str(r[1]),
                hostname=str(r[2]),
                inventory=parsed_inventory(str(r[3])),
                scheduling=str(r[4]),
                scheduling_reason=str(detail.get("reason", "")),
                scheduling_changed_at_ms=at_ms,
                scheduling_changed_by=str(detail.get("by", "")),
                connected=bool(r[5]),
                last_heartbeat_ms=int(r[6] or 0),
                disconnected_since_ms=int(r[7] or 0),
                enrolled_at_ms=int(r[8]),
                held_by=held.get(nid, {}),
                members=tuple(members.get(nid, ())),
                credential_issued_at_ms=int(r[9] or 0),
                credential_expires_at_ms=int(r[10] or 0),
                revoked_at_ms=int(r[11] or 0),
                name=str(r[12]) or nid,
                dialed_address=str(r[13]),
                outputs_address=str(r[14]),
            )
        )
    return views


async def resolve_node(store: Store, ref: str) -> str:
    """The id of the Node ``ref`` names: its id, its display name when one Fleet has it, or
    ``FLEET/NAME``. Raises :class:`NotFound`, or :class:`Conflict` when several Fleets have a
    Node of that name (the sentence lists them as ``FLEET/NAME``)."""
    if await fetch_rows(store, "SELECT 1 FROM nodes WHERE id = ?", (ref,)):
        return ref
    fleet, _, name = ref.rpartition("/")
    sql, args = "SELECT id, fleet FROM nodes WHERE name = ?", [name]
    if fleet:
        sql += " AND fleet = ?"
        args.append(fleet)
    found = await fetch_rows(store, sql + " ORDER BY fleet", args)
    if len(found) == 1:
        return str(found[0][0])
    if not found:
        raise NotFound(f"there is no Node {ref!r}. List the Nodes with `tp node ls`.")
    both = ", ".join(f"{f}/{name}" for _, f in found)
    raise Conflict(f"several Fleets have a Node named {name!r}; name one of {both}, or its id.")


async def node_view(store: Store, node_id: str) -> Node:
    found = await node_views(store, node_id=node_id)
    if not found:
        raise NotFound(f"there is no Node {node_id!r}. List the Nodes with `tp node ls`.")
    return found[0]


def _capacity(
    fleet: str, nodes: Sequence[Node], quotas: Mapping[PoolKey, int]
) -> tuple[SeriesCapacity, ...]:
    counts: dict[str, list[int]] = {}  # series -> [total, healthy, free, in use]
    for node in nodes:
        takes_work = node.connected and node.scheduling == SCHEDULABLE
        for gpu in node.inventory.gpus:
            c = counts.setdefault(gpu.series, [0, 0, 0, 0])
            c[0] += 1
            c[1] += gpu.healthy
            reserved = gpu.index in node.held_by
            c[2] += gpu.healthy and takes_work and not reserved
            c[3] += reserved
    for f, series in quotas:
        if f == fleet:
            counts.setdefault(series, [0, 0, 0, 0])
    return tuple(
        SeriesCapacity(s, c[0], c[1], c[2], c[3], quotas.get((fleet, s), 0))
        for s, c in sorted(counts.items())
    )


async def fleet_views(store: Store, quotas: Mapping[PoolKey, int], name: str = "") -> list[Fleet]:
    """Every Fleet (or only ``name``) with its Nodes counted and its GPUs per Series."""
    fleets = await fetch_rows(
        store,
        "SELECT name, kind, created_at_ms FROM fleets "
        + ("WHERE name = ? " if name else "")
        + "ORDER BY name",
        (name,) if name else (),
    )
    if name and not fleets:
        raise NotFound(f"there is no Fleet {name!r}. List the Fleets with `tp fleet ls`.")
    nodes = await node_views(store, fleet=name)
    jobs: dict[str, list[int]] = {}
    for fleet, state, count in await fetch_rows(
        store, "SELECT fleet, state, COUNT(*) FROM jobs GROUP BY fleet, state"
    ):
        c = jobs.setdefault(str(fleet), [0, 0])
        if state == lc.QUEUED:
            c[0] += int(count)
        elif state not in lc.TERMINAL_JOB_STATES:
            c[1] += int(count)
    views = []
    for fname, kind, created in fleets:
        mine = [n for n in nodes if n.fleet == fname]
        queued, active = jobs.get(str(fname), [0, 0])
        views.append(
            Fleet(
                name=str(fname),
                kind=str(kind),
                created_at_ms=int(created),
                nodes=len(mine),
                connected_nodes=sum(n.connected for n in mine),
                schedulable_nodes=sum(n.scheduling == SCHEDULABLE for n in mine),
                capacity=_capacity(str(fname), mine, quotas),
                queued_jobs=queued,
                active_jobs=active,
            )
        )
    return views


async def outputs_services(store: Store, node_ids: Collection[str]) -> dict[str, OutputsService]:
    """node id -> where it serves outputs, for those of ``node_ids`` that serve any now (as
    their last Hello said) and are not revoked; one read for all of them."""
    if not node_ids:
        return {}
    marks = ", ".join("?" for _ in node_ids)
    found: dict[str, OutputsService] = {}
    for nid, address, digest, key in await fetch_rows(
        store,
        "SELECT id, outputs_address, outputs_cert_sha256, outputs_grant_key FROM nodes "
        f"WHERE id IN ({marks}) AND revoked_at_ms IS NULL AND outputs_address <> ''",
        sorted(node_ids),
    ):
        try:
            found[str(nid)] = OutputsService(str(address), str(digest), bytes.fromhex(str(key)))
        except ValueError:
            log.warning("stored outputs grant key unreadable node=%s; no grant made", nid)
    return found


async def holder(store: Store, node_id: str) -> Holder | None:
    """What a Derivation's Preview needs to know of the Node that holds a source's outputs:
    its name, whether it serves outputs, was declared lost (and has not connected since) or is
    revoked; None when there is no such Node."""
    rows = await fetch_rows(
        store,
        "SELECT name, outputs_address, revoked_at_ms FROM nodes WHERE id = ?",
        (node_id,),
    )
    if not rows:
        return None
    name, address, revoked = rows[0]
    last = await fetch_rows(
        store,
        "SELECT kind FROM decisions WHERE node_id = ? AND kind IN (?, ?) ORDER BY id DESC LIMIT 1",
        (node_id, "node declared lost", "node connected"),
    )
    return Holder(
        node_id=node_id,
        name=str(name) or node_id,
        outputs_address=str(address),
        lost=bool(last) and last[0][0] == "node declared lost",
        retired=revoked is not None,
    )


async def healthy_gpus_per_node(store: Store, fleet: str, series: str) -> list[int]:
    """For each enrolled Node of ``fleet``, its healthy GPUs of ``series`` (any state)."""
    return [
        sum(1 for g in parsed_inventory(str(inv)).gpus if g.healthy and g.series == series)
        for (inv,) in await fetch_rows(
            store, "SELECT inventory_json FROM nodes WHERE fleet = ?", (fleet,)
        )
    ]
