"""The store's Fleet, Node-scheduling, user and queue-status operations.

Rules:
- These run on the coordinator :class:`~tuneplane.coordinator.store.core.Store` with its own
  discipline: each write is one store transaction (one writer at a time), shielded from the
  caller's deadline, and each decision (cordon, uncordon, drain, drained, user created) appends
  to ``decisions`` in the same transaction. Reads never write.
- A Node's scheduling state (``nodes.scheduling``) is set only here and is independent of its
  connectivity: a disconnected Node can be cordoned, and a cordoned Node stays connected.
- A Node "holds" a member until that member's last known state is terminal (exited, aborted,
  lost); a draining Node becomes ``drained`` once it holds none.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from .. import lifecycle as lc
from ..derivation import Holder
from ..placement import CORDONED, DRAINED, DRAINING, SCHEDULABLE, Request
from ..queue_plan import NodeState, PoolKey, QueuedRequest
from ..values.fleet import Fleet, Node, NodeMember, SeriesCapacity
from ..values.jobs import MemberKey
from ..values.orders import Inventory, OutputsService
from ..values.users import User
from .core import Conflict, NotFound, Store

log = logging.getLogger(__name__)

# What an admin may ask for; ``drained`` is reached, never requested.
REQUESTABLE = (SCHEDULABLE, CORDONED, DRAINING)
_DECISION_KIND = {
    SCHEDULABLE: "node uncordoned",
    CORDONED: "node cordoned",
    DRAINING: "node draining",
    DRAINED: "node drained",
}
SCHEDULING_KINDS = tuple(_DECISION_KIND.values())
_TERMINAL = tuple(sorted(lc.TERMINAL_MEMBER_STATES))
_LIVE = f"known_state NOT IN ({', '.join('?' for _ in _TERMINAL)})"


@functools.lru_cache(maxsize=8192)
def _inventory(text: str) -> Inventory:
    """A Node's inventory parsed from its stored JSON, cached by that text: every pass and every
    Preview reads each Node's inventory, it rarely changes, and parsing one costs far more than
    looking it up. The value is frozen, so sharing it is safe."""
    return Inventory.from_json(text)


async def _rows(store: Store, sql: str, args: Sequence[Any] = ()) -> list[Any]:
    return list(await store.reader.execute_fetchall(sql, tuple(args)))


# ----- reads ------------------------------------------------------------------------------------


async def _node_rows(store: Store, fleet: str, node_id: str) -> list[Any]:
    clauses, args = [], []
    if fleet:
        clauses.append("fleet = ?")
        args.append(fleet)
    if node_id:
        clauses.append("id = ?")
        args.append(node_id)
    where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
    return await _rows(
        store,
        "SELECT id, fleet, hostname, inventory_json, scheduling, connected, last_heartbeat_ms, "
        "disconnected_since_ms, enrolled_at_ms, credential_issued_at_ms, "
        "credential_expires_at_ms, revoked_at_ms, name, dialed_address, outputs_address "
        f"FROM nodes {where} "
        "ORDER BY fleet, id",
        args,
    )


async def _reservations(store: Store) -> dict[str, dict[int, MemberKey]]:
    """node id -> GPU index -> the member holding it."""
    held: dict[str, dict[int, MemberKey]] = {}
    for node_id, gpu, run_id, attempt, index in await _rows(
        store, "SELECT node_id, gpu_index, run_id, attempt, member_index FROM reservations"
    ):
        held.setdefault(str(node_id), {})[int(gpu)] = MemberKey(
            str(run_id), int(attempt), int(index)
        )
    return held


async def node_views(store: Store, fleet: str = "", node_id: str = "") -> list[Node]:
    """Every Node (of ``fleet`` when given; only ``node_id`` when given), by Fleet then id."""
    rows = await _node_rows(store, fleet, node_id)
    if not rows:
        return []
    held = await _reservations(store)
    members: dict[str, list[NodeMember]] = {}
    for nid, run_id, attempt, index, state, gpus, owner in await _rows(
        store,
        "SELECT m.node_id, m.run_id, m.attempt, m.member_index, m.state, m.gpu_indexes_json, "
        f"j.owner FROM members m JOIN jobs j ON j.run_id = m.run_id WHERE m.{_LIVE} "
        "ORDER BY m.run_id, m.attempt, m.member_index",
        _TERMINAL,
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
    for nid, at_ms, detail in await _rows(
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
                inventory=_inventory(str(r[3])),
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
    if await _rows(store, "SELECT 1 FROM nodes WHERE id = ?", (ref,)):
        return ref
    fleet, _, name = ref.rpartition("/")
    sql, args = "SELECT id, fleet FROM nodes WHERE name = ?", [name]
    if fleet:
        sql += " AND fleet = ?"
        args.append(fleet)
    found = await _rows(store, sql + " ORDER BY fleet", args)
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
    fleets = await _rows(
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
    for fleet, state, count in await _rows(
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
    for nid, address, digest, key in await _rows(
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
    rows = await _rows(
        store,
        "SELECT name, outputs_address, revoked_at_ms FROM nodes WHERE id = ?",
        (node_id,),
    )
    if not rows:
        return None
    name, address, revoked = rows[0]
    last = await _rows(
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
        sum(1 for g in _inventory(str(inv)).gpus if g.healthy and g.series == series)
        for (inv,) in await _rows(
            store, "SELECT inventory_json FROM nodes WHERE fleet = ?", (fleet,)
        )
    ]


# ----- what the scheduler reads -----------------------------------------------------------------


async def node_states(
    store: Store, is_connected: Callable[[str], bool], fleets: Sequence[str]
) -> list[NodeState]:
    """The Nodes of ``fleets`` with their free healthy GPUs per Series; connectivity from the
    live sessions. Only connected Nodes are read: no other can take a member now."""
    if not fleets:
        return []
    held = await _reservations(store)
    states = []
    marks = ", ".join("?" for _ in fleets)
    for node_id, fleet, inv, scheduling in await _rows(
        store,
        f"SELECT id, fleet, inventory_json, scheduling FROM nodes WHERE fleet IN ({marks}) "
        "AND connected = 1 ORDER BY id",
        fleets,
    ):
        taken = held.get(str(node_id), {})
        free: dict[str, list[int]] = {}
        for g in _inventory(str(inv)).gpus:
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
        for fleet, series, count in await _rows(
            store,
            "SELECT j.fleet, j.series, COUNT(*) FROM reservations r JOIN jobs j "
            "ON j.run_id = r.run_id GROUP BY j.fleet, j.series",
        )
    }


async def queued_requests(store: Store) -> tuple[list[QueuedRequest], dict[str, str]]:
    """The queue as a pass reads it, oldest first, and each queued Job's recorded reason.

    One read of ``jobs`` alone (by its state index): the resolved JobSpecs are read only for the
    Jobs that launch (:meth:`Store.queued_job`). Equal shapes share one :class:`Request`.
    """
    shapes: dict[tuple[int, int | None, int | None], Request] = {}
    queue: list[QueuedRequest] = []
    reasons: dict[str, str] = {}
    for run_id, fleet, series, gpus, members, per_member, reason in await _rows(
        store,
        "SELECT run_id, fleet, series, gpus, members_wanted, gpus_per_member, state_reason "
        "FROM jobs WHERE state = ? ORDER BY created_at_ms, run_id",
        (lc.QUEUED,),
    ):
        shape = (int(gpus), members, per_member)
        request = shapes.get(shape)
        if request is None:
            request = shapes[shape] = Request(*shape)
        queue.append(QueuedRequest(str(run_id), str(fleet), str(series), request))
        reasons[str(run_id)] = str(reason)
    return queue, reasons


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

    await store.shielded(work)


async def state_reasons(store: Store, run_ids: Sequence[str]) -> dict[str, str]:
    """The recorded reason for each Job's current state."""
    if not run_ids:
        return {}
    marks = ", ".join("?" for _ in run_ids)
    return {
        str(r): str(why)
        for r, why in await _rows(
            store, f"SELECT run_id, state_reason FROM jobs WHERE run_id IN ({marks})", run_ids
        )
    }


# ----- scheduling changes -----------------------------------------------------------------------


async def set_scheduling(
    store: Store, node_id: str, wanted: str, by: str, reason: str, now: int
) -> None:
    """Cordon (``cordoned``), drain (``draining``) or uncordon (``schedulable``) a Node.

    Asking for the state a Node is already in changes nothing and logs nothing; draining a Node
    that is already drained keeps it drained. A Node that holds no members drains at once.
    """
    if wanted not in REQUESTABLE:
        raise ValueError(f"cannot request scheduling state {wanted!r}")

    async def work() -> None:
        async with store.transaction() as db:
            rows = list(
                await db.execute_fetchall("SELECT scheduling FROM nodes WHERE id = ?", (node_id,))
            )
            if not rows:
                raise NotFound(f"there is no Node {node_id!r}. List the Nodes with `tp node ls`.")
            current = str(rows[0][0])
            if current == wanted or (wanted == DRAINING and current == DRAINED):
                return
            await _move(store, db, node_id, current, wanted, by, reason, now)
            if wanted == DRAINING and not await _holds_members(db, node_id):
                await _move(store, db, node_id, DRAINING, DRAINED, by, "it holds no members", now)

    await store.shielded(work)


async def cordon_in(store: Store, db: Any, node_id: str, by: str, reason: str, now: int) -> bool:
    """Inside the caller's transaction: cordon the Node if it is schedulable (a Node declared
    lost); False when it already takes no new work (cordoned, draining, drained)."""
    rows = list(await db.execute_fetchall("SELECT scheduling FROM nodes WHERE id = ?", (node_id,)))
    if not rows or str(rows[0][0]) != SCHEDULABLE:
        return False
    await _move(store, db, node_id, SCHEDULABLE, CORDONED, by, reason, now)
    return True


async def _holds_members(db: Any, node_id: str) -> bool:
    rows = await db.execute_fetchall(
        f"SELECT 1 FROM members WHERE node_id = ? AND {_LIVE} LIMIT 1", (node_id, *_TERMINAL)
    )
    return bool(list(rows))


async def _move(
    store: Store,
    db: Any,
    node_id: str,
    old: str,
    new: str,
    by: str,
    reason: str,
    now: int,
) -> None:
    await db.execute("UPDATE nodes SET scheduling = ? WHERE id = ?", (new, node_id))
    await store.log_decision(
        db,
        now,
        _DECISION_KIND[new],
        {"from": old, "to": new, "by": by, "reason": reason},
        node_id=node_id,
    )
    log.info("node scheduling node=%s from=%s to=%s by=%s reason=%s", node_id, old, new, by, reason)


async def mark_drained(store: Store, now: int) -> list[str]:
    """Move every draining Node that holds no members to ``drained``; returns their ids."""
    candidates = await _rows(
        store,
        "SELECT id FROM nodes n WHERE scheduling = ? AND NOT EXISTS (SELECT 1 FROM members m "
        f"WHERE m.node_id = n.id AND m.{_LIVE})",
        (DRAINING, *_TERMINAL),
    )
    if not candidates:
        return []

    async def work() -> list[str]:
        done = []
        async with store.transaction() as db:
            for (node_id,) in candidates:
                row = list(
                    await db.execute_fetchall(
                        "SELECT scheduling FROM nodes WHERE id = ?", (str(node_id),)
                    )
                )
                if row[0][0] != DRAINING or await _holds_members(db, str(node_id)):
                    continue
                await _move(
                    store,
                    db,
                    str(node_id),
                    DRAINING,
                    DRAINED,
                    "coordinator",
                    "its last member ended",
                    now,
                )
                done.append(str(node_id))
        return done

    return await store.shielded(work)


# ----- users ------------------------------------------------------------------------------------


async def create_user(
    store: Store,
    name: str,
    token_hash: str,
    role: str,
    now: int,
    expires_at_ms: int | None = None,
) -> None:
    async def work() -> None:
        async with store.transaction() as db:
            rows = await db.execute_fetchall("SELECT 1 FROM users WHERE name = ?", (name,))
            if list(rows):
                raise Conflict(f"the user {name!r} already exists. Pick another name.")
            await db.execute(
                "INSERT INTO users (name, token_hash, role, created_at_ms, expires_at_ms) "
                "VALUES (?, ?, ?, ?, ?)",
                (name, token_hash, role, now, expires_at_ms),
            )
            await store.log_decision(
                db,
                now,
                "user created",
                {"user": name, "role": role, "expires_at_ms": expires_at_ms},
            )

    await store.shielded(work)


async def users(store: Store) -> list[User]:
    return [
        User(str(n), str(r), int(c))
        for n, r, c in await _rows(
            store, "SELECT name, role, created_at_ms FROM users ORDER BY name"
        )
    ]
