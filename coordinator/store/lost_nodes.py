"""The store's side of a Node that never comes back: declaring it lost, the Cancels its
members get when it returns, and which disconnected Nodes still hold live members.

Rules:
- These run on the coordinator :class:`~tuneplane.coordinator.store.core.Store` with its discipline:
  each write is one store transaction (one writer at a time), shielded from the caller's
  deadline, and each decision appends to ``decisions`` in the same transaction.
- Declaring a Node lost (:func:`declare_node_lost`, decisions from
  :mod:`~tuneplane.coordinator.node_loss`) is one transaction: its live members end, their GPUs
  go back, their siblings are stopped, their Jobs are refreshed and the Node is cordoned. A
  repeat finds nothing left to do and writes nothing.
"""

from __future__ import annotations

import logging

import attrs

from .. import launch, node_loss
from .. import lifecycle as lc
from ..values.jobs import MemberKey
from ..values.orders import CancelOrder, HeldMember, Order
from .core import Conflict, NotFound, Store
from .fleet_rows import LIVE_MEMBER, TERMINAL_STATES
from .handle import Handle, first_row
from .lifecycle import CANCEL, grace_period_s, stop_siblings_of
from .node_scheduling import cordon_in

log = logging.getLogger(__name__)


@attrs.frozen
class NodeLoss:
    """What declaring a Node lost did.

    ``lost``: the members it ended (lost, or aborted with their undecided attempt). ``orders``:
    Cancel and Abort orders for the members on *other* Nodes that worked with them. ``runs``: the
    Jobs it touched. ``cordoned``: whether it cordoned the Node. Nothing changed when all are
    empty or false.
    """

    lost: tuple[MemberKey, ...] = ()
    orders: tuple[Order, ...] = ()
    runs: tuple[str, ...] = ()
    cordoned: bool = False

    @property
    def changed(self) -> bool:
        return bool(self.lost) or self.cordoned


async def declare_node_lost(
    store: Store, node_id: str, by: str, reason: str, now: int, *, connected: bool | None = None
) -> NodeLoss:
    """Declare the Node lost (see :mod:`~tuneplane.coordinator.node_loss`), in one transaction.

    ``connected`` is whether the serving coordinator holds a live stream of the Node; None when
    no coordinator serves (the admin CLI writing the store directly), where the store's own
    ``connected`` flag may be left over from a crash and no Node can be connected. Raises
    :class:`NotFound` for an unknown Node and :class:`Conflict` (a sentence) for a connected one
    or an empty reason.
    """
    try:
        why = node_loss.check_reason(reason)
    except node_loss.NodeLossRefused as exc:
        raise Conflict(str(exc)) from None
    declaration = node_loss.declared(by, why)

    async def work() -> NodeLoss:
        async with store.transaction() as db:
            row = await first_row(db, "SELECT connected FROM nodes WHERE id = ?", (node_id,))
            if row is None:
                raise NotFound(f"there is no Node {node_id!r}. List the Nodes with `tp node ls`.")
            try:
                # Checked inside the transaction too: a Hello recorded since the caller looked
                # wins, and the operator is told.
                node_loss.check_declarable(
                    node_id, bool(connected) or (connected is not None and bool(row[0]))
                )
            except node_loss.NodeLossRefused as exc:
                raise Conflict(str(exc)) from None
            rows = await db.execute_fetchall(
                "SELECT m.run_id, m.attempt, m.member_index, a.decision FROM members m "
                "JOIN attempts a ON a.run_id = m.run_id AND a.number = m.attempt "
                f"WHERE m.node_id = ? AND m.{LIVE_MEMBER} "
                "ORDER BY m.run_id, m.attempt, m.member_index",
                (node_id, *TERMINAL_STATES),
            )
            lost: list[MemberKey] = []
            orders: list[Order] = []
            runs: set[str] = set()
            for run_id, attempt, index, decision in rows:
                key = MemberKey(str(run_id), int(attempt), int(index))
                lost.append(key)
                runs.add(key.run_id)
                orders += await _end_member(store, db, key, decision, declaration, node_id, now)
            cordoned = await cordon_in(store, db, node_id, by, declaration, now)
            result = NodeLoss(
                tuple(lost),
                tuple(o for o in orders if o.node_id != node_id),
                tuple(sorted(runs)),
                cordoned,
            )
            if result.changed:
                await store.log_decision(
                    db, now, "node declared lost",
                    {"by": by, "reason": why, "cordoned": cordoned,
                     "members": [k.text for k in lost]},
                    node_id=node_id,
                )  # fmt: skip
            return result

    result = await store.shielded(work)
    log.info(
        "node declared lost node=%s by=%s changed=%s members=%d runs=%s cordoned=%s reason=%s",
        node_id, by, result.changed, len(result.lost), ",".join(result.runs) or "-",
        result.cordoned, why,
    )  # fmt: skip
    return result


async def _end_member(
    store: Store,
    db: Handle,
    key: MemberKey,
    decision: str | None,
    declaration: str,
    node_id: str,
    now: int,
) -> list[Order]:
    """End one live member of a lost Node as :func:`node_loss.member_fate` says; its orders."""
    await db.execute(
        "UPDATE members SET declared_lost = ? WHERE run_id = ? AND attempt = ? "
        "AND member_index = ?",
        (declaration, key.run_id, key.attempt, key.member_index),
    )
    await store.log_decision(db, now, "member declared lost", {"why": declaration}, member=key)
    fate = node_loss.member_fate(None if decision is None else str(decision))
    if fate == node_loss.ABORT_ATTEMPT:
        why = node_loss.abort_reason(key.member_index, node_id, declaration)
        return await store.launch_event(db, key.run_id, key.attempt, launch.NodeLost(why), now)
    await store.set_member_state(db, key, lc.M_LOST, now, declaration, known=lc.M_LOST)
    await store.release_member(db, key, now, declaration)
    orders: list[Order] = []
    cancelled = await first_row(
        db,
        "SELECT 1 FROM attempt_stops WHERE run_id = ? AND attempt = ? AND kind = ?",
        (key.run_id, key.attempt, CANCEL),
    )
    if cancelled is None and decision == lc.COMMIT:
        orders = await stop_siblings_of(store, db, key, declaration, now)
    await store.refresh_job(db, key.run_id, now)
    return orders


async def declared_lost_order(store: Store, node_id: str, member: MemberKey) -> CancelOrder | None:
    """The Cancel a Node gets for its member that was declared lost; None for any other member
    (and for a member of another Node, which learns nothing here)."""
    orders = await _declared_lost_orders(store, node_id, [member])
    return orders[0] if orders else None


async def declared_lost_stops(
    store: Store, node_id: str, held: list[HeldMember]
) -> list[CancelOrder]:
    """Cancel orders, sent after Welcome, for the members this Node's Hello says it still holds
    but that were declared lost while it was away: it stops them and journals why."""
    return await _declared_lost_orders(store, node_id, [h.member for h in held])


async def _declared_lost_orders(
    store: Store, node_id: str, members: list[MemberKey]
) -> list[CancelOrder]:
    orders: list[CancelOrder] = []
    for key in members:
        row = await first_row(
            store.reader,
            "SELECT declared_lost FROM members WHERE run_id = ? AND attempt = ? "
            "AND member_index = ? AND node_id = ? AND declared_lost <> ''",
            (key.run_id, key.attempt, key.member_index, node_id),
        )
        if row is not None:
            grace = await grace_period_s(store.reader, key.run_id)
            orders.append(CancelOrder(node_id, key, str(row[0]), grace, declared_lost=True))
    return orders


@attrs.frozen
class DisconnectedNode:
    """A disconnected Node that holds live members, as :func:`disconnected_holders` reads it."""

    node_id: str
    fleet: str
    disconnected_since_ms: int | None


async def disconnected_holders(store: Store, fleets: list[str]) -> list[DisconnectedNode]:
    """Disconnected Nodes of ``fleets`` that still hold a live member (max_disconnect's look)."""
    if not fleets:
        return []
    marks = ", ".join("?" for _ in fleets)
    rows = await store.reader.execute_fetchall(
        "SELECT n.id, n.fleet, n.disconnected_since_ms FROM nodes n "
        f"WHERE n.connected = 0 AND n.fleet IN ({marks}) AND EXISTS (SELECT 1 FROM members m "
        f"WHERE m.node_id = n.id AND m.{LIVE_MEMBER}) ORDER BY n.id",
        (*fleets, *TERMINAL_STATES),
    )
    return [DisconnectedNode(str(i), str(f), None if s is None else int(s)) for i, f, s in rows]
