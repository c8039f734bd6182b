"""The store's Job lifecycle operations: cancel, stop the siblings of a failed member, retry.

Rules:
- These run on the coordinator :class:`~tuneplane.coordinator.store.core.Store` with its discipline:
  each write is one store transaction (one writer at a time), shielded from the caller's
  deadline, and each decision appends to ``decisions`` in the same transaction.
- A stop is recorded (``attempt_stops``) before any Cancel is sent, and the orders are returned
  for the caller to dispatch; a Node that is away gets them from :func:`stops_to_resend` when it
  reconnects. Every operation here is safe to repeat.
- Only a person's cancel decides a Job's state (``cancelling`` -> ``cancelled``); stopping the
  siblings of a failed member (an exit, a loss, or a launch its Node could not carry out) leaves
  the Job ``failed`` with that member's reason.
- Declaring a Node lost (:func:`declare_node_lost`, decisions from
  :mod:`~tuneplane.coordinator.node_loss`) is one transaction: its live members end, their GPUs
  go back, their siblings are stopped, their Jobs are refreshed and the Node is cordoned. A
  repeat finds nothing left to do and writes nothing.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import attrs

from .. import launch, node_loss
from .. import lifecycle as lc
from ..auth import PermissionDenied
from ..values.jobs import MemberKey
from ..values.lifecycle import (
    ALREADY_CANCELLED,
    ALREADY_CANCELLING,
    ALREADY_ENDED,
    CANCELLED,
    CANCELLING,
)
from ..values.orders import CancelOrder, HeldMember, Order
from . import fleet as store_fleet
from .core import Conflict, NotFound, Store
from .handle import Handle, first_row

log = logging.getLogger(__name__)

CANCEL = "cancel"
STOP_SIBLINGS = "stop-siblings"
DEFAULT_GRACE_S = 30

_TERMINAL = tuple(sorted(lc.TERMINAL_MEMBER_STATES))
_LIVE = f"known_state NOT IN ({', '.join('?' for _ in _TERMINAL)})"


@attrs.frozen
class CancelResult:
    """What a cancel did: its outcome word and the orders to send (Cancel or Abort)."""

    outcome: str
    orders: tuple[Order, ...] = ()


def _may_change(run_id: str, owner: str, who: str, is_admin: bool, what: str) -> None:
    if who != owner and not is_admin:
        raise PermissionDenied(
            f"the Job {run_id} belongs to {owner}; only its owner or an admin may {what} it."
        )


async def _grace_period_s(db: Handle, run_id: str) -> int:
    row = await first_row(
        db,
        "SELECT p.resolved_json FROM jobs j JOIN previews p ON p.id = j.preview_id "
        "WHERE j.run_id = ?",
        (run_id,),
    )
    try:
        grace = json.loads(str(row[0])).get("grace_period_s", DEFAULT_GRACE_S)
    except (TypeError, ValueError, AttributeError):
        return DEFAULT_GRACE_S
    return grace if isinstance(grace, int) and grace >= 0 else DEFAULT_GRACE_S


async def _record_stop(
    store: Store,
    db: Handle,
    run_id: str,
    attempt: int,
    kind: str,
    reason: str,
    grace: int,
    who: str,
    now: int,
) -> bool:
    """Write the stop decision once; False when this attempt already had one of this kind."""
    row = await first_row(
        db,
        "SELECT 1 FROM attempt_stops WHERE run_id = ? AND attempt = ? AND kind = ?",
        (run_id, attempt, kind),
    )
    if row is not None:
        return False
    await db.execute(
        "INSERT INTO attempt_stops (run_id, attempt, kind, reason, grace_period_s, requested_by, "
        "requested_at_ms) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (run_id, attempt, kind, reason, grace, who, now),
    )
    await store.log_decision(
        db,
        now,
        kind,
        {"attempt": attempt, "reason": reason, "grace_period_s": grace, "by": who},
        run_id=run_id,
    )
    return True


async def _live_members(
    db: Handle, run_id: str, attempt: int, but: int | None = None
) -> list[tuple[MemberKey, str]]:
    rows = await db.execute_fetchall(
        f"SELECT member_index, node_id FROM members WHERE run_id = ? AND attempt = ? AND {_LIVE} "
        "ORDER BY member_index",
        (run_id, attempt, *_TERMINAL),
    )
    return [
        (MemberKey(run_id, attempt, int(idx)), str(node))
        for idx, node in rows
        if but is None or int(idx) != but
    ]


async def cancel_job(
    store: Store, run_id: str, who: str, is_admin: bool, reason: str, now: int
) -> CancelResult:
    """Record a person's cancel and return the orders that carry it out.

    queued: ``cancelled`` at once, nothing to send. Reserved and undecided: the launch is
    aborted (Abort to each Node, GPUs released), ``cancelled``. Committed: ``cancelling`` and a
    Cancel (with the JobSpec's grace period) to every member that has not ended.
    """

    async def work() -> CancelResult:
        async with store.transaction() as db:
            row = await first_row(db, "SELECT state, owner FROM jobs WHERE run_id = ?", (run_id,))
            if row is None:
                raise NotFound(f"there is no Job with run id {run_id!r}. Check it with `tp ls`.")
            state, owner = str(row[0]), str(row[1])
            _may_change(run_id, owner, who, is_admin, "cancel")
            if state == lc.CANCELLED:
                return CancelResult(ALREADY_CANCELLED)
            if state in lc.TERMINAL_JOB_STATES:
                return CancelResult(ALREADY_ENDED)
            why = f"cancelled by {who}" + (f": {reason}" if reason else "")
            if state == lc.QUEUED:
                await _cancel_queued(store, db, run_id, state, why, now)
                return CancelResult(CANCELLED)
            (number, decision) = await first_row(
                db,
                "SELECT number, decision FROM attempts WHERE run_id = ? "
                "ORDER BY number DESC LIMIT 1",
                (run_id,),
            )
            number = int(number)
            grace = await _grace_period_s(db, run_id)
            fresh = await _record_stop(store, db, run_id, number, CANCEL, why, grace, who, now)
            if decision is None:
                aborts = await store.launch_event(db, run_id, number, launch.Cancelled(why), now)
                return CancelResult(CANCELLED, tuple(aborts))
            live = await _live_members(db, run_id, number)
            await store.refresh_job(db, run_id, now)
            stops = tuple(CancelOrder(node, key, why, grace) for key, node in live)
            return CancelResult(CANCELLING if fresh else ALREADY_CANCELLING, stops)

    return await store.shielded(work)


async def _cancel_queued(
    store: Store, db: Handle, run_id: str, state: str, why: str, now: int
) -> None:
    lc.check_job_move(state, lc.CANCELLED)
    await db.execute(
        "UPDATE jobs SET state = ?, state_reason = ?, updated_at_ms = ? WHERE run_id = ?",
        (lc.CANCELLED, why, now, run_id),
    )
    await db.execute(
        "INSERT INTO job_states (run_id, state, reason, at_ms) VALUES (?, ?, ?, ?)",
        (run_id, lc.CANCELLED, why, now),
    )
    await store.log_decision(
        db, now, "state change", {"from": state, "to": lc.CANCELLED, "reason": why}, run_id=run_id
    )
    log.info("job cancelled while queued run_id=%s reason=%s", run_id, why)


def _failure(state: str, has_exit: bool, exit_code: int, signal: int) -> bool:
    # An aborted member here was committed (an undecided attempt's abort leaves no live sibling,
    # and a person's cancel is handled before): its Node could not start it.
    facts = lc.MemberFacts(0, state, has_exit, exit_code, signal)
    return lc.failure_sentence(facts) is not None


async def stop_siblings(store: Store, member: MemberKey, now: int) -> list[Order]:
    """After ``member`` reported: if it failed, stop every other live member of its attempt.

    Returns Cancel orders the first time (and again on a repeat, which a Node answers from its
    journal); nothing when the member did not fail, had no live siblings, or the attempt was
    cancelled by a person (that Cancel is already on its way).
    """

    async def work() -> list[Order]:
        async with store.transaction() as db:
            row = await first_row(
                db,
                "SELECT state, has_exit, exit_code, signal FROM members WHERE run_id = ? "
                "AND attempt = ? AND member_index = ?",
                (member.run_id, member.attempt, member.member_index),
            )
            if row is None or not _failure(str(row[0]), bool(row[1]), int(row[2]), int(row[3])):
                return []
            cancelled = await first_row(
                db,
                "SELECT 1 FROM attempt_stops WHERE run_id = ? AND attempt = ? AND kind = ?",
                (member.run_id, member.attempt, CANCEL),
            )
            if cancelled is not None:
                return []
            return await _stop_siblings_of(store, db, member, _describe(row), now)

    return await store.shielded(work)


async def _stop_siblings_of(
    store: Store, db: Handle, member: MemberKey, what: str, now: int
) -> list[Order]:
    """Inside a transaction: record the stop of ``member``'s live siblings (``what`` says how it
    failed) and return their Cancel orders; none when it has no live sibling."""
    live = await _live_members(db, member.run_id, member.attempt, but=member.member_index)
    if not live:
        return []
    why = f"member {member.member_index} failed ({what}); stopping the others"
    grace = await _grace_period_s(db, member.run_id)
    await _record_stop(
        store, db, member.run_id, member.attempt, STOP_SIBLINGS, why, grace, "coordinator", now
    )
    return [CancelOrder(node, key, why, grace) for key, node in live]


def _describe(row: Any) -> str:
    state, _has_exit, exit_code, signal = row
    if state == lc.M_LOST:
        return "lost by its Node"
    if state == lc.M_ABORTED:
        return "it could not be started on its Node"
    return f"signal {signal}" if signal else f"exit code {exit_code}"


async def stops_to_resend(store: Store, node_id: str) -> list[CancelOrder]:
    """Cancel orders for this Node's members that a recorded stop has not yet ended.

    Sent after every Hello, so a Node that was disconnected when the stop was decided still
    stops its members. A member whose Node already reported it ended gets nothing.
    """
    rows = await store.reader.execute_fetchall(
        "SELECT m.run_id, m.attempt, m.member_index, s.reason, s.grace_period_s FROM members m "
        "JOIN attempt_stops s ON s.run_id = m.run_id AND s.attempt = m.attempt "
        f"WHERE m.node_id = ? AND m.{_LIVE} ORDER BY m.run_id, m.attempt, m.member_index, s.kind",
        (node_id, *_TERMINAL),
    )
    orders: dict[MemberKey, CancelOrder] = {}
    for run_id, attempt, idx, reason, grace in rows:
        key = MemberKey(str(run_id), int(attempt), int(idx))
        # 'cancel' sorts before 'stop-siblings': a person's reason wins when both exist.
        orders.setdefault(key, CancelOrder(node_id, key, str(reason), int(grace)))
    return list(orders.values())


async def retry_job(store: Store, run_id: str, who: str, is_admin: bool, now: int) -> int:
    """Queue an ended Job (failed, cancelled, aborted) for a new attempt; returns its number.

    The same resolved JobSpec runs again: the scheduler places the queued Job afresh and
    :meth:`Store.reserve_launch` numbers the attempt. Raises :class:`Conflict` (a sentence) for a
    Job that has not ended or that succeeded.
    """

    async def work() -> int:
        async with store.transaction() as db:
            row = await first_row(db, "SELECT state, owner FROM jobs WHERE run_id = ?", (run_id,))
            if row is None:
                raise NotFound(f"there is no Job with run id {run_id!r}. Check it with `tp ls`.")
            state, owner = str(row[0]), str(row[1])
            _may_change(run_id, owner, who, is_admin, "retry")
            try:
                lc.check_retry(run_id, state)
            except lc.NotRetryable as exc:
                raise Conflict(str(exc)) from None
            (last,) = await first_row(
                db, "SELECT COALESCE(MAX(number), 0) FROM attempts WHERE run_id = ?", (run_id,)
            )
            number = int(last) + 1
            why = f"retry requested by {who}; attempt {number} waits for free GPUs"
            await db.execute(
                "UPDATE jobs SET state = ?, state_reason = ?, updated_at_ms = ? WHERE run_id = ?",
                (lc.QUEUED, why, now, run_id),
            )
            await db.execute(
                "INSERT INTO job_states (run_id, state, reason, at_ms) VALUES (?, ?, ?, ?)",
                (run_id, lc.QUEUED, why, now),
            )
            await store.log_decision(
                db, now, "retry", {"from": state, "attempt": number, "by": who}, run_id=run_id
            )
            log.info("job retry queued run_id=%s attempt=%d by=%s", run_id, number, who)
            return number

    return await store.shielded(work)


# ----- a Node that never comes back -------------------------------------------------------------


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
                f"WHERE m.node_id = ? AND m.{_LIVE} ORDER BY m.run_id, m.attempt, m.member_index",
                (node_id, *_TERMINAL),
            )
            lost: list[MemberKey] = []
            orders: list[Order] = []
            runs: set[str] = set()
            for run_id, attempt, index, decision in rows:
                key = MemberKey(str(run_id), int(attempt), int(index))
                lost.append(key)
                runs.add(key.run_id)
                orders += await _end_member(store, db, key, decision, declaration, node_id, now)
            cordoned = await store_fleet.cordon_in(store, db, node_id, by, declaration, now)
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
        orders = await _stop_siblings_of(store, db, key, declaration, now)
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
            grace = await _grace_period_s(store.reader, key.run_id)
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
        f"WHERE m.node_id = n.id AND m.{_LIVE}) ORDER BY n.id",
        (*fleets, *_TERMINAL),
    )
    return [DisconnectedNode(str(i), str(f), None if s is None else int(s)) for i, f, s in rows]
