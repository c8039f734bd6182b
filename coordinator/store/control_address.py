"""The control address Nodes are told to dial, as the store keeps it (``control_address``).

Rules (docs/operator.md, "Moving the coordinator"):
- One address at a time, with who set it and when; empty means none (no row). Each change is a
  decision (:data:`DECISION`) in the same transaction; setting the address it already is writes
  nothing.
- The address is checked before it gets here
  (:func:`~tuneplane.coordinator.control_address.check`); this only stores it.
"""

from __future__ import annotations

from .core import Store
from .handle import first_row

DECISION = "control address set"


async def current(store: Store) -> str:
    """The address Nodes are told to dial; "" when none was set."""
    found = await first_row(store.reader, "SELECT address FROM control_address", ())
    return str(found[0]) if found else ""


async def record(store: Store, address: str, by: str, now: int) -> bool:
    """Store ``address`` (checked by the caller) as a decision by ``by``; False when it was
    already the address (nothing written)."""

    async def work() -> bool:
        async with store.transaction() as db:
            found = await first_row(db, "SELECT address FROM control_address", ())
            previous = str(found[0]) if found else ""
            if previous == address:
                return False
            await db.execute("DELETE FROM control_address")
            if address:
                await db.execute(
                    "INSERT INTO control_address (id, address, set_at_ms, set_by) "
                    "VALUES (1, ?, ?, ?)",
                    (address, now, by),
                )
            await store.log_decision(
                db, now, DECISION, {"address": address, "previous": previous, "by": by}
            )
            return True

    return await store.shielded(work)
