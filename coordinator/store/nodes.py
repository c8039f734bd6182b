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

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from tuneplane.agent.crashpoint import crashpoint

from .. import lifecycle as lc
from ..group_commit import GroupCommitStatistics
from ..values.fleet import NodeRecord
from ..values.jobs import MemberKey
from ..values.orders import HeldMember, Inventory, Order, OutputsService
from .group_writes import GroupWriter
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
        replaced: ReplacedStream | None = None,
    ) -> list[Order]:
        """Record a Hello: the Node is connected (at ``dialed_address``, the control address it
        dialed, serving outputs at ``outputs``, checked by the caller; None clears what an
        earlier Hello said); unknown members get their real state back. ``replaced``: the live
        stream this one ended, audited first (as :meth:`session_replaced` does).

        Returns the orders to (re)send: Prepare for members still waiting for one, and the
        decision for members whose attempt is already decided. Hellos that arrive together are
        written in one transaction (group commit), each exactly as if it were alone, in the
        order they came; this returns once that transaction committed.
        """
        hello = NodeHello(node_id, inventory, tuple(held), now, dialed_address, outputs, replaced)
        return await self._hellos.submit(hello)

    def hello_statistics(self) -> GroupCommitStatistics:
        """How this store's Hellos were grouped into transactions so far."""
        return self._hellos.statistics()

    @functools.cached_property
    def _hellos(self) -> GroupWriter[NodeHello, list[Order]]:
        return GroupWriter(self, self._write_hellos, "hello", weigh=lambda h: 1 + len(h.held))

    async def _write_hellos(self, db: Handle, hellos: Sequence[NodeHello]) -> list[list[Order]]:
        """Record ``hellos`` in order in one transaction. A Node with no member rows has no
        unknown member and is owed no order, so a run of such Hellos is two statements."""
        holders = await _nodes_holding_members(db, sorted({h.node_id for h in hellos}))
        results: list[list[Order]] = []
        plain: list[NodeHello] = []
        for hello in hellos:
            if hello.node_id not in holders:
                plain.append(hello)
                results.append([])
                continue
            await self._record_hellos(db, plain)
            plain = []
            results.append(await self._hello_of_holder(db, hello))
        await self._record_hellos(db, plain)
        return results

    async def _record_hellos(self, db: Handle, hellos: Sequence[NodeHello]) -> None:
        """The node rows and decisions of ``hellos`` (in order), as executemany."""
        if not hellos:
            return
        await db.executemany(_CONNECTED, [_connected_args(h) for h in hellos])
        rows: list[tuple[Any, ...]] = []
        for h in hellos:
            if h.replaced is not None:
                rows.append(_decision(h.node_id, h.replaced.at_ms, *_replaced_decision(h)))
            rows.append(_decision(h.node_id, h.now, "node connected", _connected_detail(h)))
        await db.executemany(_DECISION, rows)

    async def _hello_of_holder(self, db: Handle, hello: NodeHello) -> list[Order]:
        """One Hello of a Node that holds members: its row, then its members and orders."""
        node_id, now = hello.node_id, hello.now
        await self._record_hellos(db, [hello])
        held_states = {h.member: h.state for h in hello.held}
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
                # Judged like a report (lifecycle.held_after_hello): only this Node's members
                # are read, and only a reachable state is taken.
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

        replaced = ReplacedStream(old_peer, new_peer, old_opened_at_ms, now)

        async def work() -> None:
            async with self.transaction() as db:
                await self.log_decision(db, now, *replaced.decision(), node_id=node_id)

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


@attrs.frozen
class ReplacedStream:
    """A second Connect of one Node ended its live stream (opened at ``old_opened_at_ms`` from
    ``old_peer``) at ``at_ms``: audited as "control stream replaced"."""

    old_peer: str
    new_peer: str
    old_opened_at_ms: int
    at_ms: int

    def decision(self) -> tuple[str, dict[str, Any]]:
        """The decision row's kind and detail."""
        return "control stream replaced", {
            "old_peer": self.old_peer,
            "new_peer": self.new_peer,
            "old_opened_at_ms": self.old_opened_at_ms,
        }


@attrs.frozen
class NodeHello:
    """What :meth:`NodeConnections.node_connected` records of one Hello."""

    node_id: str
    inventory: Inventory
    held: tuple[HeldMember, ...]
    now: int
    dialed_address: str = ""
    outputs: OutputsService | None = None
    replaced: ReplacedStream | None = None


_CONNECTED = (
    "UPDATE nodes SET connected = 1, disconnected_since_ms = NULL, last_heartbeat_ms = ?, "
    "inventory_json = ?, hostname = ?, dialed_address = ?, outputs_address = ?, "
    "outputs_cert_sha256 = ?, outputs_grant_key = ? WHERE id = ?"
)
#: What :meth:`StoreBase.log_decision` writes, for many Node decisions in one executemany.
_DECISION = (
    "INSERT INTO decisions (at_ms, kind, run_id, attempt, member_index, node_id, detail_json) "
    "VALUES (?, ?, NULL, NULL, NULL, ?, ?)"
)


def _connected_args(h: NodeHello) -> tuple[Any, ...]:
    out = h.outputs
    return (
        h.now,
        h.inventory.to_json(),
        h.inventory.hostname,
        h.dialed_address,
        out.address if out else "",
        out.cert_sha256 if out else "",
        out.grant_key.hex() if out else "",
        h.node_id,
    )


def _connected_detail(h: NodeHello) -> dict[str, Any]:
    detail = {"dialed": h.dialed_address} if h.dialed_address else {}
    if h.outputs:
        detail["outputs"] = h.outputs.address
    return detail


def _replaced_decision(h: NodeHello) -> tuple[str, dict[str, Any]]:
    assert h.replaced is not None
    return h.replaced.decision()


def _decision(node_id: str, at_ms: int, kind: str, detail: dict[str, Any]) -> tuple[Any, ...]:
    return (at_ms, kind, node_id, json.dumps(detail, sort_keys=True))


async def _nodes_holding_members(db: Handle, node_ids: Sequence[str]) -> set[str]:
    """Which of ``node_ids`` have any member row (placed on them, in any state, ever)."""
    found: set[str] = set()
    for start in range(0, len(node_ids), _IN_CHUNK):
        chunk = node_ids[start : start + _IN_CHUNK]
        marks = ", ".join("?" for _ in chunk)
        rows = await db.execute_fetchall(
            f"SELECT DISTINCT node_id FROM members WHERE node_id IN ({marks})", chunk
        )
        found.update(str(r[0]) for r in rows)
    return found


#: Node ids per ``IN (...)`` (SQLite's and asyncpg's parameter limits are far above it).
_IN_CHUNK = 500
