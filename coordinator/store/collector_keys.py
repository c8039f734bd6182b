"""The telemetry store's collector credentials: issued per member, extended by its Node's
heartbeats, ended with the member.

Rules:
- A credential row holds the token's hash, never the token, and names one member (run,
  attempt, member index) and the Node it runs on.
- Every write is one shielded transaction: a caller's deadline never leaves half of one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..values.jobs import MemberKey
from ..values.telemetry import CollectorGrant
from .db import StoreDb


class CollectorKeys(StoreDb):
    """The telemetry store's collector credential rows (one per issued token)."""

    async def issue_credentials(
        self, grants: Sequence[tuple[str, MemberKey, str]], now: int, ttl_ms: int
    ) -> None:
        """Record ``(token hash, member, node id)`` grants, valid until ``now + ttl_ms``."""

        async def work() -> None:
            async with self.transaction() as db:
                await db.executemany(
                    "INSERT INTO collector_credentials (token_hash, run_id, attempt, "
                    "member_index, node_id, issued_at_ms, expires_at_ms) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    [
                        (h, k.run_id, k.attempt, k.member_index, node, now, now + ttl_ms)
                        for h, k, node in grants
                    ],
                )

        await self.shielded(work)

    async def grant_for(self, token_hash: str) -> CollectorGrant | None:
        rows = list(
            await self.reader.execute_fetchall(
                "SELECT run_id, attempt, member_index, node_id, issued_at_ms, expires_at_ms, "
                "ended_at_ms FROM collector_credentials WHERE token_hash = ?",
                (token_hash,),
            )
        )
        if not rows:
            return None
        r = rows[0]
        return CollectorGrant(
            MemberKey(str(r[0]), int(r[1]), int(r[2])),
            str(r[3]),
            int(r[4]),
            int(r[5]),
            None if r[6] is None else int(r[6]),
        )

    async def refresh_credentials(
        self, beats: Mapping[str, int], ttl_ms: int, slack_ms: int
    ) -> int:
        """For each Node's heartbeat time ``at`` in ``beats`` (node id -> ms), extend the
        credentials of its members that have not ended to ``at + ttl``, in one transaction.

        Only rows within ``ttl - slack`` of expiring are written, so a heartbeat usually
        writes nothing. Returns how many were extended.
        """

        async def work() -> int:
            async with self.transaction() as db:
                # executemany: one trip to the database thread; rowcount sums the rows.
                cursor = await db.executemany(
                    "UPDATE collector_credentials SET expires_at_ms = ? WHERE node_id = ? "
                    "AND ended_at_ms IS NULL AND expires_at_ms < ?",
                    [
                        (at + ttl_ms, node_id, at + ttl_ms - slack_ms)
                        for node_id, at in sorted(beats.items())
                    ],
                )
                return int(cursor.rowcount)

        return await self.shielded(work)

    async def member_ended(self, member: MemberKey, now: int, drain_ms: int) -> None:
        """The member reached a terminal state: its credentials last ``drain_ms`` more, once."""

        async def work() -> None:
            async with self.transaction() as db:
                await db.execute(
                    "UPDATE collector_credentials SET ended_at_ms = ?, expires_at_ms = ? "
                    "WHERE run_id = ? AND attempt = ? AND member_index = ? "
                    "AND ended_at_ms IS NULL",
                    (now, now + drain_ms, member.run_id, member.attempt, member.member_index),
                )

        await self.shielded(work)
