"""Grouped credential lookups answer exactly what one lookup at a time answers: current and
pending credentials, a revoked Node's, and an unknown one. On SQLite and PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import anyio

from tests.support.store_backend import current
from tuneplane.coordinator.store import identity
from tuneplane.coordinator.store.core import Store
from tuneplane.coordinator.store.credential_lookups import CredentialLookups
from tuneplane.coordinator.store.identity import NodeCredentialMatch
from tuneplane.coordinator.values.orders import Inventory

NOW = 1000


def test_lookups_together_answer_what_lookups_alone_answer(tmp_path: Path) -> None:
    async def go() -> tuple[list[NodeCredentialMatch | None], list[NodeCredentialMatch | None]]:
        store = await Store.open(current().where(tmp_path / "c.db"))
        try:
            await store.bootstrap("admin-hash", NOW)
            for i in range(6):
                await store.create_join_token(f"join-{i}", "default", NOW, NOW + 600_000)
                expires = None if i == 0 else NOW + 3_600_000
                await store.enroll(
                    f"join-{i}", f"node-{i}", Inventory(f"h{i}"), f"c{i}", NOW, expires
                )
            assert await identity.issue_next_credential(store, "node-2", "next-2", NOW + 5, NOW + 9)
            assert await identity.revoke_node(store, "node-3", "ada", "stolen", NOW + 6)
            asked = ["c0", "c1", "next-2", "c2", "nobody", "c5", "c1", "c3"]
            alone = [await identity.node_for_credential(store, h) for h in asked]
            lookups = CredentialLookups(store)
            together: list[NodeCredentialMatch | None] = [None] * len(asked)

            async def one(i: int) -> None:
                together[i] = await lookups.node_for_credential(asked[i])

            async with anyio.create_task_group() as tg:
                for i in range(len(asked)):
                    tg.start_soon(one, i)
            return alone, together
        finally:
            await store.close()

    alone, together = anyio.run(go)
    assert together == alone
    assert alone[2] is not None and alone[2].is_next and alone[3] is not None
    assert alone[4] is None
    assert alone[7] is not None and alone[7].life.revoked_at_ms is not None
