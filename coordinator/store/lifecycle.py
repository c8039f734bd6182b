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
"""

from __future__ import annotations

import json
import logging
from typing import Any

import attrs

from .. import launch
from .. import lifecycle as lc
from ..auth import PermissionDenied
from ..job_access import may_change
from ..values.jobs import MemberKey
from ..values.lifecycle import (
    ALREADY_CANCELLED,
    ALREADY_CANCELLING,
    ALREADY_ENDED,
    CANCELLED,
    CANCELLING,
)
from ..values.orders import CancelOrder, Order
from .core import Conflict, NotFound, Store
from .fleet_rows import LIVE_MEMBER, TERMINAL_STATES
from .handle import Handle, first_row

log = logging.getLogger(__name__)

CANCEL = "cancel"
STOP_SIBLINGS = "stop-siblings"
DEFAULT_GRACE_S = 30


@attrs.frozen
class CancelResult:
    """What a cancel did: its outcome word and the orders to send (Cancel or Abort)."""

    outcome: str
    orders: tuple[Order, ...] = ()


def _may_change(run_id: str, owner: str, who: str, is_admin: bool, what: str) -> None:
    if not may_change(owner, who, is_admin):
        raise PermissionDenied(
            f"the Job {run_id} belongs to {owner}; only its owner or an admin may {what} it."
        )


async def grace_period_s(db: Handle, run_id: str) -> int:
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
        "SELECT member_index, node_id FROM members WHERE run_id = ? AND attempt = ? "
        f"AND {LIVE_MEMBER} ORDER BY member_index",
        (run_id, attempt, *TERMINAL_STATES),
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
            grace = await grace_period_s(db, run_id)
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
    # An aborted member of a committed attempt: its Node could not start it (an undecided or
    # aborted attempt stops no sibling, and a person's cancel is handled before).
    facts = lc.MemberFacts(0, state, has_exit, exit_code, signal)
    return lc.failure_sentence(facts) is not None


async def stop_siblings(store: Store, member: MemberKey, now: int) -> list[Order]:
    """After ``member`` reported: if it failed, stop every other live member of its attempt.

    Returns Cancel orders the first time (and again on a repeat, which a Node answers from its
    journal); nothing when the member did not fail, had no live siblings, its attempt was not
    committed (the launch decides an abort and tells every member itself) or the attempt was
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
            decided = await first_row(
                db,
                "SELECT decision FROM attempts WHERE run_id = ? AND number = ?",
                (member.run_id, member.attempt),
            )
            if decided is None or decided[0] != lc.COMMIT:
                # Undecided: the member refused Prepare, and its PrepareReply (or the prepare
                # deadline) decides the abort, which is recorded before any sibling is told;
                # its report may come first. Aborted: the Abort orders stop everyone.
                return []
            cancelled = await first_row(
                db,
                "SELECT 1 FROM attempt_stops WHERE run_id = ? AND attempt = ? AND kind = ?",
                (member.run_id, member.attempt, CANCEL),
            )
            if cancelled is not None:
                return []
            return await stop_siblings_of(store, db, member, _describe(row), now)

    return await store.shielded(work)


async def stop_siblings_of(
    store: Store, db: Handle, member: MemberKey, what: str, now: int
) -> list[Order]:
    """Inside a transaction: record the stop of ``member``'s live siblings (``what`` says how it
    failed) and return their Cancel orders; none when it has no live sibling."""
    live = await _live_members(db, member.run_id, member.attempt, but=member.member_index)
    if not live:
        return []
    why = f"member {member.member_index} failed ({what}); stopping the others"
    grace = await grace_period_s(db, member.run_id)
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
        f"WHERE m.node_id = ? AND m.{LIVE_MEMBER} "
        "ORDER BY m.run_id, m.attempt, m.member_index, s.kind",
        (node_id, *TERMINAL_STATES),
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
