"""The member and Job bookkeeping every store transaction that moves a member ends with: a
member's state and its history row, a member's GPUs released, and the Job's state derived again.

Rules:
- Called inside a transaction the caller holds (``db``); nothing here opens one or decides a
  move: the caller (a launch step, a judged report, a Node's loss) has decided it.
- A Job's state is derived from its latest attempt by the pure
  :func:`~tuneplane.coordinator.lifecycle.derive_job_state` (an attempt run as a Slurm job, by
  :func:`~tuneplane.coordinator.slurm_attempt.derive_job_state`); a change is recorded with its
  reason in ``job_states`` and ``decisions``.
"""

from __future__ import annotations

import logging

from .. import lifecycle as lc
from ..slurm_attempt import derive_job_state as derive_slurm_state
from ..values.jobs import MemberKey
from .base import StoreBase
from .handle import Handle, first_row
from .slurm_facts import slurm_facts
from .slurm_members import member_exits

log = logging.getLogger(__name__)


class MemberStates(StoreBase):
    """Member states, releases and Job states, inside a transaction."""

    async def append_member_history(
        self, db: Handle, key: MemberKey, state: str, reason: str, now: int
    ) -> None:
        await db.execute(
            "INSERT INTO member_states (run_id, attempt, member_index, state, reason, at_ms) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (key.run_id, key.attempt, key.member_index, state, reason, now),
        )

    async def set_member_state(
        self,
        db: Handle,
        key: MemberKey,
        state: str,
        now: int,
        reason: str,
        known: str,
    ) -> None:
        await db.execute(
            "UPDATE members SET state = ?, known_state = ?, updated_at_ms = ? "
            "WHERE run_id = ? AND attempt = ? AND member_index = ?",
            (state, known, now, key.run_id, key.attempt, key.member_index),
        )
        await self.append_member_history(db, key, state, reason, now)

    async def release_member(self, db: Handle, key: MemberKey, now: int, why: str) -> None:
        cursor = await db.execute(
            "DELETE FROM reservations WHERE run_id = ? AND attempt = ? AND member_index = ?",
            (key.run_id, key.attempt, key.member_index),
        )
        if cursor.rowcount:
            await self.log_decision(
                db, now, "release", {"why": why, "gpus": cursor.rowcount}, member=key
            )

    async def refresh_job(self, db: Handle, run_id: str, now: int) -> None:
        """Derive the Job's state from its latest attempt; record a change with its reason.

        Every transaction that moves a member (or records Slurm's word) ends here, so this is
        where the Job is marked changed for its watchers, state or not."""
        self.changed(run_id)
        (current,) = await first_row(db, "SELECT state FROM jobs WHERE run_id = ?", (run_id,))
        attempt = list(
            await db.execute_fetchall(
                "SELECT number, decision, decision_reason FROM attempts WHERE run_id = ? "
                "ORDER BY number DESC LIMIT 1",
                (run_id,),
            )
        )
        facts: list[lc.MemberFacts] = []
        decision: str | None = None
        decision_reason = ""
        cancel_reason: str | None = None
        if attempt:
            number, decision, decision_reason = attempt[0]
            # The reason of each member's latest state: a launch failure's sentence from its
            # Node becomes the Job's reason.
            for idx, state, has_exit, code, sig, why, lost in await db.execute_fetchall(
                "SELECT m.member_index, m.state, m.has_exit, m.exit_code, m.signal, "
                "(SELECT s.reason FROM member_states s WHERE s.run_id = m.run_id "
                " AND s.attempt = m.attempt AND s.member_index = m.member_index "
                " ORDER BY s.id DESC LIMIT 1), m.declared_lost "
                "FROM members m WHERE m.run_id = ? AND m.attempt = ? ORDER BY m.member_index",
                (run_id, number),
            ):
                facts.append(
                    lc.MemberFacts(
                        int(idx), str(state), bool(has_exit), code, sig, str(why or ""), str(lost)
                    )
                )
            cancel = await first_row(
                db,
                "SELECT reason FROM attempt_stops WHERE run_id = ? AND attempt = ? "
                "AND kind = 'cancel'",
                (run_id, number),
            )
            cancel_reason = None if cancel is None else str(cancel[0])
        derived, reason = lc.derive_job_state(decision, str(decision_reason), facts, cancel_reason)
        if attempt:
            # An attempt run as one Slurm job has no member rows: Slurm's word decides.
            slurm = await slurm_facts(db, run_id, int(number))
            if slurm is not None:
                exits = await member_exits(db, run_id, int(number))
                derived, reason = derive_slurm_state(slurm, cancel_reason, exits)
                if not lc.may_follow(str(current), derived):
                    # A move the Job lifecycle lacks: the Job keeps its state until Slurm says
                    # more.
                    log.warning("slurm state kept run_id=%s state=%s slurm=%s",
                                run_id, current, slurm.slurm_state)  # fmt: skip
                    return
        new = lc.next_job_state(str(current), derived)
        if new == current:
            return
        await db.execute(
            "UPDATE jobs SET state = ?, state_reason = ?, updated_at_ms = ? WHERE run_id = ?",
            (new, reason, now, run_id),
        )
        await db.execute(
            "INSERT INTO job_states (run_id, state, reason, at_ms) VALUES (?, ?, ?, ?)",
            (run_id, new, reason, now),
        )
        await self.log_decision(
            db, now, "state change", {"from": current, "to": new, "reason": reason}, run_id=run_id
        )
        log.info("job state run_id=%s from=%s to=%s reason=%s", run_id, current, new, reason)
