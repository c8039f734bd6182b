"""A Node's Hello as the store records it: the Node connected, its unknown members back, the
orders it is still owed; Hellos that arrive together share one transaction.

Rules:
- Hellos are written by group commit (:mod:`~tuneplane.coordinator.store.group_writes`), in the
  order they came, each exactly as it would be alone; each returns once its transaction
  committed, so no Welcome goes out before its Hello is durable.
- A Node with no member row has no unknown member and is owed no order: a run of such Hellos
  is two statements (the node rows, the decisions), whatever its length.
- A Hello that ended a live stream of its Node audits that first ("control stream replaced").
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

import attrs

from .. import lifecycle as lc
from ..group_commit import GroupCommitStatistics
from ..values.jobs import MemberKey
from ..values.orders import HeldMember, Inventory, Order, OutputsService
from .group_writes import GroupWriter
from .handle import Handle
from .launch_steps import LaunchSteps


class NodeHellos(LaunchSteps):
    """Hellos, recorded in groups."""

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
        return (await self.hello(hello)).orders

    async def hello(self, hello: NodeHello) -> Welcomed:
        """:meth:`node_connected`, saying too whether the Node holds any member at all."""
        return await self._hellos.submit(hello)

    def hello_statistics(self) -> GroupCommitStatistics:
        """How this store's Hellos were grouped into transactions so far."""
        return self._hellos.statistics()

    @functools.cached_property
    def _hellos(self) -> GroupWriter[NodeHello, Welcomed]:
        return GroupWriter(self, self._write_hellos, "hello", weigh=lambda h: 1 + len(h.held))

    async def _write_hellos(self, db: Handle, hellos: Sequence[NodeHello]) -> list[Welcomed]:
        """Record ``hellos`` in order in one transaction. A Node with no member rows has no
        unknown member and is owed no order, so a run of such Hellos is two statements."""
        holders = await _nodes_holding_members(db, sorted({h.node_id for h in hellos}))
        results: list[Welcomed] = []
        plain: list[NodeHello] = []
        for hello in hellos:
            if hello.node_id not in holders:
                plain.append(hello)
                results.append(Welcomed([], holds_members=False))
                continue
            await self._record_hellos(db, plain)
            plain = []
            results.append(Welcomed(await self._hello_of_holder(db, hello), holds_members=True))
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
                rows.append(decision_row(h.node_id, h.replaced.at_ms, *h.replaced.decision()))
            rows.append(decision_row(h.node_id, h.now, "node connected", _connected_detail(h)))
        await db.executemany(DECISION, rows)

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
class Welcomed:
    """What a Hello's write returns: the orders to (re)send, and whether the Node had any member
    row when it was written (one that had none is owed no stop either: the gateway need not
    look)."""

    orders: list[Order]
    holds_members: bool


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
DECISION = (
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


def decision_row(node_id: str, at_ms: int, kind: str, detail: dict[str, Any]) -> tuple[Any, ...]:
    """A row of :data:`DECISION`: what ``log_decision`` writes for a decision about a Node."""
    return (at_ms, kind, node_id, json.dumps(detail, sort_keys=True))


async def _nodes_holding_members(db: Handle, node_ids: Sequence[str]) -> set[str]:
    """Which of ``node_ids`` have any member row (placed on them, in any state, ever)."""
    found: set[str] = set()
    for start in range(0, len(node_ids), IN_CHUNK):
        chunk = node_ids[start : start + IN_CHUNK]
        marks = ", ".join("?" for _ in chunk)
        rows = await db.execute_fetchall(
            f"SELECT DISTINCT node_id FROM members WHERE node_id IN ({marks})", chunk
        )
        found.update(str(r[0]) for r in rows)
    return found


#: Node ids per ``IN (...)`` (SQLite's and asyncpg's parameter limits are far above it).
IN_CHUNK = 500
