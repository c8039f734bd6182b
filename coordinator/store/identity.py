"""The store's credential operations: Node credentials' lifetimes, rotation, revocation and
re-enrolment, and user tokens' expiry and revocation.

Rules:
- Only hashes are stored, never a credential's value. Each write is one store transaction (one
  writer at a time), shielded, and every operator action or credential change
  appends to ``decisions`` in the same transaction.
- A rotation keeps the old credential valid until the Node proves it holds the new one (it says
  CredentialStored, or it connects with the new one); only then does the new one replace it.
- Whether a credential is spent (expired, revoked) is decided by the pure checks in
  :mod:`~tuneplane.coordinator.auth`; these functions read and write what they need.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import attrs

from ..auth import AuthError, CredentialLife, check_user_token
from ..values.fleet import NodeRecord
from ..values.orders import Inventory
from ..values.users import User
from .core import EnrollRefused, NotFound, Store

log = logging.getLogger(__name__)


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


async def _rows(store: Store, sql: str, args: Sequence[Any] = ()) -> list[Any]:
    return list(await store.reader.execute_fetchall(sql, tuple(args)))


async def _lives(store: Store, sql: str) -> dict[str, CredentialLife]:
    """``sql`` selects (key, issued, expires, revoked) a row: each credential's life by key."""
    return {
        str(key): CredentialLife(_int(issued), _int(expires), _int(revoked))
        for key, issued, expires, revoked in await _rows(store, sql)
    }


# ----- Node control credentials -----------------------------------------------------------------


@attrs.frozen
class NodeCredentialMatch:
    """The Node a presented control credential belongs to, and that credential's life.

    ``is_next`` is true for an issued successor the Node has not yet confirmed storing: a Connect
    with it is the proof that retires the old credential.
    """

    node: NodeRecord
    is_next: bool
    life: CredentialLife


async def node_for_credential(store: Store, credential_hash: str) -> NodeCredentialMatch | None:
    """The Node whose current or pending credential has this hash, or ``None``."""
    rows = await _rows(
        store,
        "SELECT id, fleet, hostname, connected, credential_hash, "
        "credential_issued_at_ms, credential_expires_at_ms, next_credential_issued_at_ms, "
        "next_credential_expires_at_ms, revoked_at_ms FROM nodes "
        "WHERE credential_hash = ? OR next_credential_hash = ?",
        (credential_hash, credential_hash),
    )
    if not rows:
        return None
    r = rows[0]
    node = NodeRecord(str(r[0]), str(r[1]), str(r[2]), bool(r[3]))
    is_next = str(r[4]) != credential_hash
    issued, expires = (r[7], r[8]) if is_next else (r[5], r[6])
    return NodeCredentialMatch(
        node, is_next, CredentialLife(_int(issued), _int(expires), _int(r[9]))
    )


async def start_lifetime(store: Store, node_id: str, now: int, expires_at_ms: int) -> None:
    """A credential issued before credentials expired gets its lifetime at its first Connect."""

    async def work() -> None:
        async with store.transaction() as db:
            await db.execute(
                "UPDATE nodes SET credential_issued_at_ms = ?, credential_expires_at_ms = ? "
                "WHERE id = ? AND credential_expires_at_ms IS NULL",
                (now, expires_at_ms, node_id),
            )

    await store.shielded(work)


async def issue_next_credential(
    store: Store, node_id: str, credential_hash: str, issued_at_ms: int, expires_at_ms: int
) -> bool:
    """Record the successor a renewal hands out; an unconfirmed earlier one is replaced.

    False (nothing recorded) when the Node was revoked meanwhile: it gets no successor.
    """

    async def work() -> bool:
        async with store.transaction() as db:
            cursor = await db.execute(
                "UPDATE nodes SET next_credential_hash = ?, next_credential_issued_at_ms = ?, "
                "next_credential_expires_at_ms = ? WHERE id = ? AND revoked_at_ms IS NULL",
                (credential_hash, issued_at_ms, expires_at_ms, node_id),
            )
            if cursor.rowcount != 1:
                return False
            await store.log_decision(
                db,
                issued_at_ms,
                "node credential issued",
                {"expires_at_ms": expires_at_ms},
                node_id=node_id,
            )
            return True

    return await store.shielded(work)


async def confirm_rotation(
    store: Store, node_id: str, credential_hash: str, now: int, via: str
) -> CredentialLife | None:
    """The Node holds its successor: it becomes the credential and the old one is retired.

    Returns the new credential's life, or ``None`` when ``credential_hash`` is not that Node's
    pending successor (already confirmed, replaced, or the Node was revoked meanwhile).
    """

    async def work() -> CredentialLife | None:
        async with store.transaction() as db:
            rows = list(
                await db.execute_fetchall(
                    "SELECT next_credential_issued_at_ms, next_credential_expires_at_ms "
                    "FROM nodes WHERE id = ? AND next_credential_hash = ? "
                    "AND revoked_at_ms IS NULL",
                    (node_id, credential_hash),
                )
            )
            if not rows:
                return None
            issued, expires = _int(rows[0][0]), _int(rows[0][1])
            await db.execute(
                "UPDATE nodes SET credential_hash = next_credential_hash, "
                "credential_issued_at_ms = next_credential_issued_at_ms, "
                "credential_expires_at_ms = next_credential_expires_at_ms, "
                "next_credential_hash = NULL, next_credential_issued_at_ms = NULL, "
                "next_credential_expires_at_ms = NULL WHERE id = ?",
                (node_id,),
            )
            await store.log_decision(
                db,
                now,
                "node credential rotated",
                {"via": via, "expires_at_ms": expires},
                node_id=node_id,
            )
            return CredentialLife(issued, expires)

    return await store.shielded(work)


async def revoke_node(store: Store, node_id: str, by: str, reason: str, now: int) -> bool:
    """Refuse the Node's credentials from now on; False when it was already revoked."""

    async def work() -> bool:
        async with store.transaction() as db:
            rows = list(
                await db.execute_fetchall(
                    "SELECT revoked_at_ms FROM nodes WHERE id = ?", (node_id,)
                )
            )
            if not rows:
                raise NotFound(f"there is no Node {node_id!r}. List the Nodes with `tp node ls`.")
            if rows[0][0] is not None:
                return False
            await db.execute(
                "UPDATE nodes SET revoked_at_ms = ?, next_credential_hash = NULL, "
                "next_credential_issued_at_ms = NULL, next_credential_expires_at_ms = NULL "
                "WHERE id = ?",
                (now, node_id),
            )
            await store.log_decision(
                db, now, "node revoked", {"by": by, "reason": reason}, node_id=node_id
            )
            return True

    revoked = await store.shielded(work)
    log.info("node revoke node=%s by=%s changed=%s", node_id, by, revoked)
    return revoked


async def reenroll(
    store: Store,
    join_token_hash: str,
    node_id: str,
    inventory: Inventory,
    credential_hash: str,
    expires_at_ms: int,
    now: int,
) -> str:
    """Give an existing Node a new credential for a join token made for it (`token create --node`).

    The Node keeps its id, its journal and its members; its old credential, any pending
    successor and any revocation are replaced. Raises :class:`EnrollRefused`.
    """

    async def work() -> str:
        async with store.transaction() as db:
            rows = list(
                await db.execute_fetchall("SELECT fleet FROM nodes WHERE id = ?", (node_id,))
            )
            if not rows:
                raise EnrollRefused(
                    f"there is no Node {node_id!r} to re-enroll at this coordinator. Enroll this "
                    "machine as a new Node with an empty --state-dir (no --re-enroll)."
                )
            fleet = await store.spend_join_token(
                db, join_token_hash, node_id, now, reenrolling=True
            )
            if fleet != str(rows[0][0]):
                raise EnrollRefused(
                    f"this join token is for Fleet {fleet!r}, but Node {node_id} belongs to Fleet "
                    f"{rows[0][0]!r}. Create a join token for {rows[0][0]!r} "
                    f"(`tuneplane-coordinator token create --fleet {rows[0][0]}`)."
                )
            await db.execute(
                "UPDATE nodes SET credential_hash = ?, credential_issued_at_ms = ?, "
                "credential_expires_at_ms = ?, next_credential_hash = NULL, "
                "next_credential_issued_at_ms = NULL, next_credential_expires_at_ms = NULL, "
                "revoked_at_ms = NULL, hostname = ?, inventory_json = ? WHERE id = ?",
                (
                    credential_hash,
                    now,
                    expires_at_ms,
                    inventory.hostname,
                    inventory.to_json(),
                    node_id,
                ),
            )
            await store.log_decision(
                db,
                now,
                "node re-enrolled",
                {"fleet": fleet, "hostname": inventory.hostname, "expires_at_ms": expires_at_ms},
                node_id=node_id,
            )
            return fleet

    return await store.shielded(work)


async def credential_lives(store: Store) -> dict[str, CredentialLife]:
    """Each Node's current control credential's life (what ``tp node ls`` shows)."""
    return await _lives(
        store,
        "SELECT id, credential_issued_at_ms, credential_expires_at_ms, revoked_at_ms FROM nodes",
    )


# ----- user tokens ------------------------------------------------------------------------------


async def authenticate_user(store: Store, token_hash: str, now: int) -> User:
    """The user a token belongs to; :class:`AuthError` for an unknown, expired or revoked one."""
    rows = await store.reader.execute_fetchall(
        "SELECT name, role, created_at_ms, expires_at_ms, revoked_at_ms FROM users "
        "WHERE token_hash = ?",
        (token_hash,),
    )
    if not rows:
        raise AuthError(
            "this token is not a user token of this coordinator. Use the token from "
            "`tuneplane-coordinator user create`, or the token file named in your tp context."
        )
    name, role, created, expires, revoked = rows[0]
    check_user_token(str(name), CredentialLife(int(created), _int(expires), _int(revoked)), now)
    return User(str(name), str(role), int(created))


async def issue_user_token(
    store: Store, name: str, token_hash: str, expires_at_ms: int | None, by: str, now: int
) -> None:
    """Give an existing user a new token (the old one stops working; a revocation is lifted)."""

    async def work() -> None:
        async with store.transaction() as db:
            rows = list(await db.execute_fetchall("SELECT 1 FROM users WHERE name = ?", (name,)))
            if not rows:
                raise NotFound(
                    f"there is no user {name!r}. Create it with "
                    f"`tuneplane-coordinator user create {name}`."
                )
            await db.execute(
                "UPDATE users SET token_hash = ?, expires_at_ms = ?, revoked_at_ms = NULL "
                "WHERE name = ?",
                (token_hash, expires_at_ms, name),
            )
            await store.log_decision(
                db,
                now,
                "user token issued",
                {"user": name, "by": by, "expires_at_ms": expires_at_ms},
            )

    await store.shielded(work)


async def revoke_user(store: Store, name: str, by: str, now: int) -> bool:
    """Refuse the user's token from the next call on; False when it was already revoked."""

    async def work() -> bool:
        async with store.transaction() as db:
            rows = list(
                await db.execute_fetchall("SELECT revoked_at_ms FROM users WHERE name = ?", (name,))
            )
            if not rows:
                raise NotFound(
                    f"there is no user {name!r}. List the users with "
                    "`tuneplane-coordinator user ls`."
                )
            if rows[0][0] is not None:
                return False
            await db.execute("UPDATE users SET revoked_at_ms = ? WHERE name = ?", (now, name))
            await store.log_decision(db, now, "user revoked", {"user": name, "by": by})
            return True

    return await store.shielded(work)


async def user_token_lives(store: Store) -> dict[str, CredentialLife]:
    """Each user's token's life (what ``user ls`` shows), by user name."""
    return await _lives(
        store, "SELECT name, created_at_ms, expires_at_ms, revoked_at_ms FROM users"
    )
