"""The decision a coordinator writes when it takes the lease over: the first write of its term.

Rules: ``coordinator took over`` names the coordinator, its term, the one it took over from
("" the first time) and why it could (the leader's session ended, or its lease expired), so the
decision log (``tuneplane-coordinator decisions``) shows every takeover between the decisions
made before and after it. It is written under the new term's fence: if another coordinator took
over meanwhile it is refused, as every write of the round would be.
"""

from __future__ import annotations

from typing import Protocol

from .core import Store


class TakenLease(Protocol):
    @property
    def term(self) -> int: ...

    @property
    def why(self) -> str: ...

    @property
    def previous(self) -> str: ...


async def record_takeover(store: Store, won: TakenLease, me: str, now: int) -> None:
    """Write the ``coordinator took over`` decision for ``me`` having taken lease ``won``."""

    async def work() -> None:
        async with store.transaction() as db:
            detail = {"coordinator": me, "term": won.term, "from": won.previous, "why": won.why}
            await store.log_decision(db, now, "coordinator took over", detail)

    await store.shielded(work)
