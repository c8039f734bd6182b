"""The store's users: creating one (its token stored only hashed) and listing them.

Rules: creating a user is one store transaction, shielded from the caller's deadline, that
appends ``user created`` to ``decisions``; a name is taken once.
"""

from __future__ import annotations

from ..values.users import User
from .core import Conflict, Store
from .fleet_rows import fetch_rows


async def create_user(
    store: Store,
    name: str,
    token_hash: str,
    role: str,
    now: int,
    expires_at_ms: int | None = None,
) -> None:
    async def work() -> None:
        async with store.transaction() as db:
            rows = await db.execute_fetchall("SELECT 1 FROM users WHERE name = ?", (name,))
            if list(rows):
                raise Conflict(f"the user {name!r} already exists. Pick another name.")
            await db.execute(
                "INSERT INTO users (name, token_hash, role, created_at_ms, expires_at_ms) "
                "VALUES (?, ?, ?, ?, ?)",
                (name, token_hash, role, now, expires_at_ms),
            )
            await store.log_decision(
                db,
                now,
                "user created",
                {"user": name, "role": role, "expires_at_ms": expires_at_ms},
            )

    await store.shielded(work)


async def users(store: Store) -> list[User]:
    return [
        User(str(n), str(r), int(c))
        for n, r, c in await fetch_rows(
            store, "SELECT name, role, created_at_ms FROM users ORDER BY name"
        )
    ]
