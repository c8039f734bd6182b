"""A Node's connectivity as the store records it: Hello, heartbeats, inventory, a replaced
control stream, and disconnection.

Rules:
- A Hello marks the Node connected and returns the orders it is still owed (Prepares and
  recorded decisions); a disconnection makes its live members ``unknown``, never ended: a lost
  connection is not proof that a workload stopped.
- A heartbeat is not a decision: heartbeats are stored in batches, and a time only moves
  forward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tuneplane.agent.crashpoint import crashpoint

from .. import lifecycle as lc
from ..values.fleet import NodeRecord
from ..values.jobs import MemberKey
from ..values.orders import HeldMember, Inventory, Order, OutputsService
from .handle import Handle, first_row
from .launch_steps import LaunchSteps


class NodeConnections(LaunchSteps):
    """Node connections, heartbeats and inventories."""

    async def node(self, node_id: str) -> NodeRecord | None:
        rows = list(
            await self.reader.execute_fetchall(
                "SELECT id, fleet, hostname, connected FROM nodes WHERE id = ?",
                (node_id,),
            )
        )
        if not rows:
            return None
        r = rows[0]
        return NodeRecord(str(r[0]), str(r[1]), str(r[2]), bool(r[3]))

    async def holds_member(self, node_id: str, member: MemberKey) -> bool:
        """Whether ``member`` is placed on ``node_id`` (what a Node may ship logs for)."""
        held = await first_row(
            self.reader,
            "SELECT 1 FROM members WHERE run_id = ? AND attempt = ? AND member_index = ? "
            "AND node_id = ?",
            (member.run_id, member.attempt, member.member_index, node_id),
        )
        return held is not None

    async def mark_all_disconnected(self, now: int) -> None:
        """At start-up no Node is connected yet, whatever the store said when it stopped."""

        async def work() -> None:
            async with self.transaction() as db:
                rows = await db.execute_fetchall("SELECT id FROM nodes WHERE connected = 1")
                for (node_id,) in list(rows):
                    await self._disconnect(db, str(node_id), now, "the coordinator restarted")

        await self.shielded(work)

    async def node_connected(
        self,
        node_id: str,
        inventory: Inventory,
        held: Sequence[HeldMember],
        now: int,
        dialed_address: str = "",
        outputs: OutputsService | None = None,
    ) -> list[Order]:
        """Record a Hello: the Node is connected (at ``dialed_address``, the control address it
        dialed, serving outputs at ``outputs``, checked by the caller; None clears what an
        earlier Hello said); unknown members get their real state back.

        Returns the orders to (re)send: Prepare for members still waiting for one, and the
        decision for members whose attempt is already decided.
        """

        async def work() -> list[Order]:
            async with self.transaction() as db:
                await db.execute(
                    "UPDATE nodes SET connected = 1, disconnected_since_ms = NULL, "
                    "last_heartbeat_ms = ?, inventory_json = ?, hostname = ?, "
                    "dialed_address = ?, outputs_address = ?, outputs_cert_sha256 = ?, "
                    "outputs_grant_key = ? WHERE id = ?",
                    (
                        now,
                        inventory.to_json(),
                        inventory.hostname,
                        dialed_address,
                        outputs.address if outputs else "",
                        outputs.cert_sha256 if outputs else "",
                        outputs.grant_key.hex() if outputs else "",
                        node_id,
                    ),
                )
                detail = {"dialed": dialed_address} if dialed_address else {}
                if outputs:
                    detail["outputs"] = outputs.address
                await self.log_decision(db, now, "node connected", detail, node_id=node_id)
                held_states = {h.member: h.state for h in held}
                rows = list(
                    await db.execute_fetchall(
                        "SELECT m.run_id, m.attempt, m.member_index, m.known_state, a.decision "
                        "FROM members m JOIN attempts a ON a.run_id = m.run_id "
                        "AND a.number = m.attempt WHERE m.node_id = ? AND m.state = 'unknown'",
                        (node_id,),
                    )
                )
                touched: set[str] = set()
                for run_id, attempt, index, known, decision in rows:
                    key = MemberKey(str(run_id), int(attempt), int(index))
                    new_known = str(known)
                    reported = held_states.get(key)
                    if reported is not None:
                        # Judged like a report (lifecycle.held_after_hello): only this Node's
                        # members are read, and only a reachable state is taken.
                        moved = lc.held_after_hello(
                            new_known, reported, None if decision is None else str(decision)
                        )
                        new_known = moved or new_known
                    await self.set_member_state(
                        db, key, new_known, now, "its Node reconnected", known=new_known
                    )
                    touched.add(key.run_id)
                for run_id in sorted(touched):
                    await self.refresh_job(db, run_id, now)
                return await self.orders_to_resend(db, node_id)

        return await self.shielded(work)

    async def node_heartbeats(self, beats: Mapping[str, int]) -> None:
        """Store many Nodes' latest heartbeat times (node id -> ms) in one transaction.

        A heartbeat is not a decision: the gateway acks it from memory and a flusher calls this
        once per interval. A time only moves forward, so a late batch never rewinds a newer one.
        """

        async def work() -> None:
            async with self.transaction() as db:
                await db.executemany(
                    "UPDATE nodes SET last_heartbeat_ms = MAX(COALESCE(last_heartbeat_ms, 0), ?) "
                    "WHERE id = ?",
                    [(at, node_id) for node_id, at in sorted(beats.items())],
                )
                crashpoint("mid-heartbeat-batch", beats=beats)

        await self.shielded(work)

    async def node_inventory(self, node_id: str, inventory: Inventory, now: int) -> None:
        """A heartbeat carried a changed inventory: store it (and the heartbeat time) at once."""

        async def work() -> None:
            async with self.transaction() as db:
                await db.execute(
                    "UPDATE nodes SET inventory_json = ?, "
                    "last_heartbeat_ms = MAX(COALESCE(last_heartbeat_ms, 0), ?) WHERE id = ?",
                    (inventory.to_json(), now, node_id),
                )

        await self.shielded(work)

    async def session_replaced(
        self, node_id: str, old_peer: str, new_peer: str, old_opened_at_ms: int, now: int
    ) -> None:
        """Audit a second Connect of one Node that ended its live stream (the newer one wins).

        Nothing else changes: the Node stays connected and its members keep their states.
        """

        async def work() -> None:
            async with self.transaction() as db:
                await self.log_decision(
                    db, now, "control stream replaced",
                    {"old_peer": old_peer, "new_peer": new_peer,
                     "old_opened_at_ms": old_opened_at_ms},
                    node_id=node_id,
                )  # fmt: skip

        await self.shielded(work)

    async def node_disconnected(self, node_id: str, now: int, why: str) -> None:
        """The Node's stream ended: it is ``disconnected`` and its live members ``unknown``."""

        async def work() -> None:
            async with self.transaction() as db:
                await self._disconnect(db, node_id, now, why)

        await self.shielded(work)

    async def _disconnect(self, db: Handle, node_id: str, now: int, why: str) -> None:
        await db.execute(
            "UPDATE nodes SET connected = 0, disconnected_since_ms = ? WHERE id = ?",
            (now, node_id),
        )
        await self.log_decision(db, now, "node disconnected", {"why": why}, node_id=node_id)
        terminal = tuple(sorted(lc.TERMINAL_MEMBER_STATES))
        marks = ",".join("?" for _ in terminal)
        rows = list(
            await db.execute_fetchall(
                "SELECT run_id, attempt, member_index, known_state FROM members "
                f"WHERE node_id = ? AND state <> 'unknown' AND known_state NOT IN ({marks})",
                (node_id, *terminal),
            )
        )
        touched: set[str] = set()
        for run_id, attempt, index, known in rows:
            key = MemberKey(str(run_id), int(attempt), int(index))
            await self.set_member_state(
                db, key, lc.M_UNKNOWN, now, f"its Node disconnected ({why})", known=str(known)
            )
            touched.add(key.run_id)
        for run_id in sorted(touched):
            await self.refresh_job(db, run_id, now)
