"""A Node's connectivity as the store records it: heartbeats, inventory, a replaced control
stream, and disconnection (Hello: :mod:`~tuneplane.coordinator.store.hellos`).

Rules:
- A disconnection makes the Node's live members ``unknown``, never ended: a lost connection is
  not proof that a workload stopped. Streams that end together (a network cut, a stopping
  coordinator) are recorded by group commit, each as it would be alone, in the order they ended.
- A heartbeat is not a decision: heartbeats are stored in batches, and a time only moves
  forward.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import attrs

from tuneplane.agent.crashpoint import crashpoint

from .. import lifecycle as lc
from ..group_commit import GroupCommitStatistics
from ..values.fleet import NodeRecord
from ..values.jobs import MemberKey
from ..values.orders import Inventory
from .group_writes import GroupWriter
from .handle import Handle, first_row
from .hellos import DECISION, IN_CHUNK, NodeHellos, ReplacedStream, decision_row


class NodeConnections(NodeHellos):
    """Node connections (Hello in :class:`NodeHellos`), heartbeats, inventories and
    disconnections."""

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
                gone = [NodeGone(str(r[0]), now, "the coordinator restarted") for r in rows]
                await self._write_goodbyes(db, gone)

        await self.shielded(work)

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
        """The Node's stream ended: it is ``disconnected`` and its live members ``unknown``.

        Streams that end together (a network cut, a coordinator stopping) are recorded in one
        transaction (group commit), each as it would be alone, in the order they ended.
        """
        await self._goodbyes.submit(NodeGone(node_id, now, why))

    def goodbye_statistics(self) -> GroupCommitStatistics:
        """How this store's disconnections were grouped into transactions so far."""
        return self._goodbyes.statistics()

    @functools.cached_property
    def _goodbyes(self) -> GroupWriter[NodeGone, None]:
        return GroupWriter(self, self._write_goodbyes, "disconnection")

    async def _write_goodbyes(self, db: Handle, gone: Sequence[NodeGone]) -> list[None]:
        """Record ``gone`` in order. A Node with no live member known to it is two statements'
        worth (its row, its decision) in one executemany each, however many there are."""
        holders = await _nodes_with_live_members(db, sorted({g.node_id for g in gone}))
        plain: list[NodeGone] = []
        for g in gone:
            if g.node_id in holders:
                await self._record_goodbyes(db, plain)
                plain = []
                await self._disconnect(db, g.node_id, g.now, g.why)
            else:
                plain.append(g)
        await self._record_goodbyes(db, plain)
        return [None] * len(gone)

    async def _record_goodbyes(self, db: Handle, gone: Sequence[NodeGone]) -> None:
        if gone:
            await db.executemany(_DISCONNECTED, [(g.now, g.node_id) for g in gone])
            await db.executemany(
                DECISION,
                [decision_row(g.node_id, g.now, "node disconnected", {"why": g.why}) for g in gone],
            )

    async def _disconnect(self, db: Handle, node_id: str, now: int, why: str) -> None:
        await self._record_goodbyes(db, [NodeGone(node_id, now, why)])
        rows = list(
            await db.execute_fetchall(
                f"SELECT run_id, attempt, member_index, known_state FROM members {_LIVE_KNOWN} "
                "AND node_id = ?",
                (*_TERMINAL, node_id),
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
class NodeGone:
    """A Node's stream ended at ``now``, for ``why``."""

    node_id: str
    now: int
    why: str


_DISCONNECTED = "UPDATE nodes SET connected = 0, disconnected_since_ms = ? WHERE id = ?"
_TERMINAL = tuple(sorted(lc.TERMINAL_MEMBER_STATES))
#: Members a disconnection makes ``unknown``: not already so, and not ended as far as known.
_LIVE_KNOWN = (
    f"WHERE state <> 'unknown' AND known_state NOT IN ({', '.join('?' for _ in _TERMINAL)})"
)


async def _nodes_with_live_members(db: Handle, node_ids: Sequence[str]) -> set[str]:
    """Which of ``node_ids`` hold a member a disconnection would make ``unknown``."""
    found: set[str] = set()
    for start in range(0, len(node_ids), IN_CHUNK):
        chunk = node_ids[start : start + IN_CHUNK]
        marks = ", ".join("?" for _ in chunk)
        rows = await db.execute_fetchall(
            f"SELECT DISTINCT node_id FROM members {_LIVE_KNOWN} AND node_id IN ({marks})",
            (*_TERMINAL, *chunk),
        )
        found.update(str(r[0]) for r in rows)
    return found
