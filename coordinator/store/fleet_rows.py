"""What the store's Fleet, Node and lifecycle modules share: rows read outside a transaction,
a Node's parsed inventory, the GPUs reserved on each Node and the SQL test for a live member.

Rules:
- Reads never write.
- A Node "holds" a member until that member's last known state is terminal (exited, aborted,
  lost): :data:`LIVE_MEMBER` is that test.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from .. import lifecycle as lc
from ..values.jobs import MemberKey
from ..values.orders import Inventory
from .core import Store

TERMINAL_STATES = tuple(sorted(lc.TERMINAL_MEMBER_STATES))
#: Takes :data:`TERMINAL_STATES` as its arguments.
LIVE_MEMBER = f"known_state NOT IN ({', '.join('?' for _ in TERMINAL_STATES)})"


@functools.lru_cache(maxsize=8192)
def parsed_inventory(text: str) -> Inventory:
    """A Node's inventory parsed from its stored JSON, cached by that text: every pass and every
    Preview reads each Node's inventory, it rarely changes, and parsing one costs far more than
    looking it up. The value is frozen, so sharing it is safe."""
    return Inventory.from_json(text)


async def fetch_rows(store: Store, sql: str, args: Sequence[Any] = ()) -> list[Any]:
    return list(await store.reader.execute_fetchall(sql, tuple(args)))


async def reservations_by_node(store: Store) -> dict[str, dict[int, MemberKey]]:
    """node id -> GPU index -> the member holding it."""
    held: dict[str, dict[int, MemberKey]] = {}
    for node_id, gpu, run_id, attempt, index in await fetch_rows(
        store, "SELECT node_id, gpu_index, run_id, attempt, member_index FROM reservations"
    ):
        held.setdefault(str(node_id), {})[int(gpu)] = MemberKey(
            str(run_id), int(attempt), int(index)
        )
    return held
