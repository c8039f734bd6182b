"""The store's side of the launch table (:mod:`~tuneplane.coordinator.launch`): an attempt's
facts read for :func:`launch.step`, and what a step returned persisted and turned into orders.

Rules:
- Nothing here decides anything: :func:`launch.step` does, and this writes what it returned
  (rendezvous, prepared members, the Commit or Abort decision with its ``decisions`` row,
  member states, releases) in the caller's transaction, then builds the orders it names.
- Orders are rebuilt from the store each time, so a Node that reconnects or asks is sent
  exactly what the recorded decision says.
"""

from __future__ import annotations

import json
from typing import Any

from .. import launch
from .. import lifecycle as lc
from ..values.jobs import MemberKey
from ..values.orders import AbortOrder, CommitOrder, Order, PrepareOrder
from .handle import Handle, first_row
from .member_states import MemberStates


class LaunchSteps(MemberStates):
    """Applying launch events to stored attempts, and the orders they send."""

    async def launch_event(
        self, db: Handle, run_id: str, attempt: int, event: launch.Event, now: int
    ) -> list[Order]:
        """Inside a transaction: apply one launch event (coordinator/launch.py) to an attempt."""
        facts = await self.attempt_facts(db, run_id, attempt)
        if facts is None:
            return []
        return await self.apply_launch(db, run_id, attempt, facts, launch.step(facts, event), now)

    async def attempt_facts(self, db: Handle, run_id: str, attempt: int) -> launch.Attempt | None:
        """What :func:`launch.step` reads about an attempt; None when there is no such attempt."""
        row = await first_row(
            db,
            "SELECT decision, decision_reason, master_addr, master_port, rendezvous_nonce "
            "FROM attempts WHERE run_id = ? AND number = ?",
            (run_id, attempt),
        )
        if row is None:
            return None
        members = await db.execute_fetchall(
            "SELECT member_index, node_id, prepared, known_state FROM members "
            "WHERE run_id = ? AND attempt = ? ORDER BY member_index",
            (run_id, attempt),
        )
        return launch.Attempt(
            members=tuple(
                launch.Member(int(i), str(node), bool(prepared), str(known))
                for i, node, prepared, known in members
            ),
            decision=None if row[0] is None else str(row[0]),
            reason=str(row[1]),
            master_addr=str(row[2]),
            master_port=int(row[3]),
            nonce=str(row[4]),
        )

    async def apply_launch(
        self,
        db: Handle,
        run_id: str,
        attempt: int,
        before: launch.Attempt,
        step: launch.Step,
        now: int,
    ) -> list[Order]:
        """Inside a transaction: persist what :func:`launch.step` returned, log its decision and
        build the orders it names. Nothing here decides anything."""
        after = step.attempt
        where = (run_id, attempt)
        if (after.master_addr, after.master_port, after.nonce) != (
            before.master_addr,
            before.master_port,
            before.nonce,
        ):
            await db.execute(
                "UPDATE attempts SET master_addr = ?, master_port = ?, rendezvous_nonce = ? "
                "WHERE run_id = ? AND number = ?",
                (after.master_addr, after.master_port, after.nonce, *where),
            )
        for old, new in zip(before.members, after.members, strict=True):
            if new.prepared != old.prepared:
                await db.execute(
                    "UPDATE members SET prepared = ? WHERE run_id = ? AND attempt = ? "
                    "AND member_index = ?",
                    (int(new.prepared), *where, new.index),
                )
        if step.decided == lc.ABORT:
            await self._decide(db, run_id, attempt, after, now)
        released = set(step.releases)
        for change in step.changes:
            key = MemberKey(run_id, attempt, change.member_index)
            await self.set_member_state(
                db, key, change.state, now, change.reason, known=change.state
            )
            if change.member_index in released:
                await self.release_member(db, key, now, "the launch was aborted")
        if step.decided == lc.COMMIT:
            await self._decide(db, run_id, attempt, after, now)
        if step.changes or step.decided:
            await self.refresh_job(db, run_id, now)
        prepares = {s.member_index for s in step.sends if s.kind == "prepare"}
        rows = await self._prepare_rows(db, run_id, attempt, prepares) if prepares else {}
        orders: list[Order] = []
        for send in step.sends:
            key = MemberKey(run_id, attempt, send.member_index)
            if send.kind == "prepare":
                orders.append(_prepare_order(send.node_id, key, rows[send.member_index]))
            else:
                orders.append(_order(key, send))
        return orders

    async def _decide(
        self, db: Handle, run_id: str, attempt: int, after: launch.Attempt, now: int
    ) -> None:
        """Record an attempt's decision and its ``decisions`` row."""
        await db.execute(
            "UPDATE attempts SET decision = ?, decision_reason = ?, decided_at_ms = ? "
            "WHERE run_id = ? AND number = ?",
            (after.decision, after.reason, now, run_id, attempt),
        )
        if after.decision == lc.COMMIT:
            detail: dict[str, Any] = {
                "attempt": attempt,
                "master_addr": after.master_addr,
                "master_port": after.master_port,
            }
        else:
            detail = {"attempt": attempt, "reason": after.reason}
        await self.log_decision(db, now, str(after.decision), detail, run_id=run_id)

    async def _prepare_rows(
        self, db: Handle, run_id: str, attempt: int, indexes: set[int]
    ) -> dict[int, Any]:
        """The rows :func:`_prepare_order` builds these members' Prepares from."""
        rows = await db.execute_fetchall(
            _PREPARE_ROWS + "WHERE m.run_id = ? AND m.attempt = ? ORDER BY m.member_index",
            (run_id, attempt),
        )
        return {int(r[2]): r for r in rows if int(r[2]) in indexes}

    async def decision_for(self, node_id: str, member: MemberKey) -> Order | None:
        """The recorded decision for a member this Node holds; None while undecided.

        A member the coordinator has no record of (or that is another Node's) gets Abort, so the
        Node can release what it reserved.
        """
        facts = await self.attempt_facts(self.reader, member.run_id, member.attempt)
        query = launch.DecisionQueried(node_id, member.member_index)
        if facts is None:
            return AbortOrder(node_id, member, launch.NO_RECORD)
        sends = launch.step(facts, query).sends
        return _order(member, sends[0]) if sends else None

    async def orders_to_resend(self, db: Handle, node_id: str) -> list[Order]:
        """What :func:`launch.step` sends a reconnected Node, over the attempts it holds members
        of that are undecided or committed and not yet past ``prepared`` there (the only ones the
        table can still owe it anything)."""
        attempts = await db.execute_fetchall(
            "SELECT DISTINCT m.run_id, m.attempt FROM members m JOIN attempts a "
            "ON a.run_id = m.run_id AND a.number = m.attempt WHERE m.node_id = ? "
            "AND (a.decision IS NULL OR m.known_state IN (?, ?, ?)) ORDER BY m.run_id, m.attempt",
            (node_id, *sorted(launch.BEFORE_COMMIT)),
        )
        orders: list[Order] = []
        for run_id, number in attempts:
            orders += await self.launch_event(
                db, str(run_id), int(number), launch.NodeReconnected(node_id), 0
            )
        return orders


#: The members/attempts/jobs/previews join a Prepare is built from (:func:`_prepare_order`).
_PREPARE_ROWS = (
    "SELECT m.run_id, m.attempt, m.member_index, m.gpu_indexes_json, m.prepared, "
    "m.known_state, a.decision, a.decision_reason, a.master_addr, a.master_port, "
    "a.capsule_json, p.resolved_json, "
    "(SELECT COUNT(*) FROM members o WHERE o.run_id = m.run_id AND o.attempt = m.attempt), "
    "j.owner, m.gpu_uuids_json, a.rendezvous_nonce "
    "FROM members m JOIN attempts a ON a.run_id = m.run_id AND a.number = m.attempt "
    "JOIN jobs j ON j.run_id = m.run_id JOIN previews p ON p.id = j.preview_id "
)


def _order(key: MemberKey, send: launch.Send) -> Order:
    """A decision :func:`launch.step` sends, as the order the gateway delivers."""
    if send.kind == "commit":
        return CommitOrder(send.node_id, key, send.master_addr, send.master_port)
    return AbortOrder(send.node_id, key, send.reason)


def _prepare_order(node_id: str, key: MemberKey, r: Any) -> PrepareOrder:
    """A member's Prepare from a row of :data:`_PREPARE_ROWS` (the attempt's nonce 15th):
    member 0 picks the rendezvous, every other member is told it, to prove it can reach it."""
    first = key.member_index == 0
    return PrepareOrder(
        node_id=node_id,
        member=key,
        jobspec_json=str(r[11]),
        member_count=int(r[12]),
        gpu_indexes=tuple(json.loads(r[3])),
        pick_rendezvous=first,
        capsule_files=json.loads(r[10]),
        owner=str(r[13]),
        gpu_uuids=tuple(str(u) for u in json.loads(r[14])),
        rendezvous_nonce=str(r[15]),
        master_addr="" if first else str(r[8]),
        master_port=0 if first else int(r[9]),
    )
