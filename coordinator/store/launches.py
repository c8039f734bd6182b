"""Launching a Job: the durable reservation of its whole resource envelope, the Node's
PrepareReplies, and the prepare deadline.

Rules:
- A reservation writes the attempt, its members and every GPU's reservation row in one
  transaction; the primary key on ``reservations`` refuses a GPU taken meanwhile, and then
  nothing is written.
- Each write is one shielded transaction that hands its event to
  :class:`~tuneplane.coordinator.store.launch_steps.LaunchSteps` and returns the orders to send.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence

from .. import launch
from .. import lifecycle as lc
from ..placement import Placement
from ..values.jobs import MemberKey, QueuedJob
from ..values.orders import Inventory, Order, PrepareOrder
from .handle import Handle, IntegrityViolation, first_row
from .launch_steps import LaunchSteps

log = logging.getLogger(__name__)


async def _placed_uuids(db: Handle, node_id: str, gpu_indexes: Sequence[int]) -> tuple[str, ...]:
    """The UUIDs the Node's last inventory gives ``gpu_indexes`` ("" for an index it lacks)."""
    row = await first_row(db, "SELECT inventory_json FROM nodes WHERE id = ?", (node_id,))
    gpus = {g.index: g.uuid for g in Inventory.from_json(str(row[0])).gpus} if row else {}
    return tuple(gpus.get(i, "") for i in gpu_indexes)


class Launches(LaunchSteps):
    """Reservations, PrepareReplies and expired prepares."""

    async def reserve_launch(
        self,
        job: QueuedJob,
        placement: Placement,
        seal_capsule: Callable[[int], dict[str, str]],
        prepare_deadline_ms: int,
        now: int,
    ) -> list[PrepareOrder] | None:
        """Write the launch reservation, the attempt and its members in one transaction.

        ``seal_capsule(attempt number)`` returns the capsule files recorded with the attempt.

        Returns the Prepare orders, or None when the Job is no longer queued or a GPU was taken
        meanwhile (the primary key on reservations refused it; nothing was written).
        """

        async def work() -> list[PrepareOrder] | None:
            async with self.transaction() as db:
                row = await first_row(db, "SELECT state FROM jobs WHERE run_id = ?", (job.run_id,))
                if row is None or row[0] != lc.QUEUED:
                    return None
                (last,) = await first_row(
                    db,
                    "SELECT COALESCE(MAX(number), 0) FROM attempts WHERE run_id = ?",
                    (job.run_id,),
                )
                number = int(last) + 1
                capsule_files = seal_capsule(number)
                nonce = launch.new_nonce()
                await db.execute(
                    "INSERT INTO attempts (run_id, number, prepare_deadline_ms, capsule_json, "
                    "created_at_ms, rendezvous_nonce) VALUES (?, ?, ?, ?, ?, ?)",
                    (
                        job.run_id,
                        number,
                        prepare_deadline_ms,
                        json.dumps(capsule_files, sort_keys=True),
                        now,
                        nonce,
                    ),
                )
                for m in placement.members:
                    key = MemberKey(job.run_id, number, m.index)
                    uuids = await _placed_uuids(db, m.node_id, m.gpu_indexes)
                    await db.execute(
                        "INSERT INTO members (run_id, attempt, member_index, node_id, "
                        "gpu_indexes_json, gpu_uuids_json, state, known_state, updated_at_ms) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (
                            job.run_id,
                            number,
                            m.index,
                            m.node_id,
                            json.dumps(list(m.gpu_indexes)),
                            json.dumps(list(uuids)),
                            lc.M_RESERVED,
                            lc.M_RESERVED,
                            now,
                        ),
                    )
                    await self.append_member_history(db, key, lc.M_RESERVED, "GPUs reserved", now)
                    for gpu in m.gpu_indexes:
                        await db.execute(
                            "INSERT INTO reservations (node_id, gpu_index, run_id, attempt, "
                            "member_index, created_at_ms) VALUES (?, ?, ?, ?, ?, ?)",
                            (m.node_id, gpu, job.run_id, number, m.index, now),
                        )
                await self.log_decision(
                    db,
                    now,
                    "reservation",
                    {
                        "members": [
                            {"index": m.index, "node": m.node_id, "gpus": list(m.gpu_indexes)}
                            for m in placement.members
                        ],
                        "prepare_deadline_ms": prepare_deadline_ms,
                    },
                    run_id=job.run_id,
                )
                await self.refresh_job(db, job.run_id, now)
                # The same decision issues member 0's Prepare (the others follow its
                # PrepareReply): it is in the store from now on, sent below, and sent again to a
                # Node that (re)connects or asks.
                facts = launch.Attempt(
                    tuple(launch.Member(m.index, m.node_id) for m in placement.members),
                    nonce=nonce,
                )
                step = launch.step(facts, launch.Reserved())
                orders = await self.apply_launch(db, job.run_id, number, facts, step, now)
                prepares = [o for o in orders if isinstance(o, PrepareOrder)]
                assert len(prepares) == len(orders), "a reservation sends only Prepares"
                return prepares

        try:
            return await self.shielded(work)
        except IntegrityViolation as exc:
            log.warning("reservation refused run_id=%s why=%s", job.run_id, exc)
            return None

    async def record_prepare_reply(
        self,
        node_id: str,
        member: MemberKey,
        ok: bool,
        reason: str,
        master_addr: str,
        master_port: int,
        now: int,
        rendezvous_held: bool = False,
    ) -> list[Order]:
        """Apply a PrepareReply; returns the Commit or Abort orders it caused (maybe none).

        A repeated reply for a decided attempt gets that decision again, for this member only.
        Member 0's reply says whether its Node holds the rendezvous listener; when it does not
        (an older agent) the attempt's nonce is dropped, so the other members' Prepares ask for
        no check they could never pass.
        """

        async def work() -> list[Order]:
            async with self.transaction() as db:
                facts = await self.attempt_facts(db, member.run_id, member.attempt)
                event: launch.Event
                if not ok:
                    event = launch.PrepareFailed(node_id, member.member_index, reason)
                else:
                    hostname = ""
                    if member.member_index == 0 and not master_addr:
                        # The Node left the address to us: its reported host name is the best bet.
                        (hostname,) = await first_row(
                            db, "SELECT hostname FROM nodes WHERE id = ?", (node_id,)
                        )
                    event = launch.Prepared(
                        node_id, member.member_index, master_addr, master_port,
                        rendezvous_held, str(hostname),
                    )  # fmt: skip
                step = launch.step(facts, event) if facts else None
                if facts is None or step is None or step.ignored == launch.NO_RECORD:
                    log.warning(
                        "prepare reply for a member this Node does not hold node=%s run_id=%s "
                        "attempt=%d member=%d",
                        node_id,
                        member.run_id,
                        member.attempt,
                        member.member_index,
                    )
                    return []
                if ok and member.member_index == 0 and not rendezvous_held and not facts.decision:
                    log.info(
                        "rendezvous not held by member 0's Node; not checked run_id=%s "
                        "attempt=%d node=%s", member.run_id, member.attempt, node_id,
                    )  # fmt: skip
                return await self.apply_launch(db, member.run_id, member.attempt, facts, step, now)

        return await self.shielded(work)

    async def abort_expired_prepares(self, now: int) -> list[Order]:
        """Abort every undecided attempt whose prepare deadline has passed."""
        # Every scheduling pass asks; a read answers "none" without taking the write lock.
        if not await first_row(
            self.reader,
            "SELECT 1 FROM attempts WHERE decision IS NULL AND prepare_deadline_ms <= ? LIMIT 1",
            (now,),
        ):
            return []

        async def work() -> list[Order]:
            async with self.transaction() as db:
                rows = list(
                    await db.execute_fetchall(
                        "SELECT run_id, number FROM attempts WHERE decision IS NULL "
                        "AND prepare_deadline_ms <= ?",
                        (now,),
                    )
                )
                orders: list[Order] = []
                for run_id, number in rows:
                    orders += await self.launch_event(
                        db, str(run_id), int(number), launch.PrepareTimedOut(), now
                    )
                return orders

        return await self.shielded(work)
