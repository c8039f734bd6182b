"""The store's Node scheduling changes: cordon, uncordon, drain, and drained once a draining
Node holds no members.

Rules:
- These run on the coordinator :class:`~tuneplane.coordinator.store.core.Store` with its own
  discipline: each write is one store transaction (one writer at a time), shielded from the
  caller's deadline, and each decision (cordon, uncordon, drain, drained) appends to
  ``decisions`` in the same transaction.
- A Node's scheduling state (``nodes.scheduling``) is set only here and is independent of its
  connectivity: a disconnected Node can be cordoned, and a cordoned Node stays connected.
- A Node "holds" a member until that member's last known state is terminal (exited, aborted,
  lost); a draining Node becomes ``drained`` once it holds none.
"""

from __future__ import annotations

import logging
from typing import Any

from ..placement import CORDONED, DRAINED, DRAINING, SCHEDULABLE
from .core import NotFound, Store
from .fleet_rows import LIVE_MEMBER, TERMINAL_STATES, fetch_rows

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
        f"SELECT 1 FROM members WHERE node_id = ? AND {LIVE_MEMBER} LIMIT 1",
        (node_id, *TERMINAL_STATES),
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
    candidates = await fetch_rows(
        store,
        "SELECT id FROM nodes n WHERE scheduling = ? AND NOT EXISTS (SELECT 1 FROM members m "
        f"WHERE m.node_id = n.id AND m.{LIVE_MEMBER})",
        (DRAINING, *TERMINAL_STATES),
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
