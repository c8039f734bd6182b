"""Which Node a control credential belongs to, for many Connects at once.

Rules:
- The answer is :func:`~tuneplane.coordinator.store.identity.node_for_credential`'s, read the
  same way (a read, no transaction), but the lookups of Connects that arrive together share
  one query (:class:`~tuneplane.coordinator.store.group_writes.GroupWriter`, reads only): after
  a restart 5,000 Nodes authenticate at once, and on SQLite each read is a hop to the
  database's thread that waits for the event loop's busy thread to let go (about 5 ms each).
- Nothing is cached: a credential revoked or rotated from another process is seen by the next
  lookup, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..auth import CredentialLife
from ..values.fleet import NodeRecord
from .core import Store
from .group_writes import GroupWriter
from .handle import Handle
from .hellos import IN_CHUNK
from .identity import NodeCredentialMatch

_COLUMNS = (
    "SELECT id, fleet, hostname, connected, credential_hash, credential_issued_at_ms, "
    "credential_expires_at_ms, next_credential_issued_at_ms, next_credential_expires_at_ms, "
    "revoked_at_ms, next_credential_hash FROM nodes "
)


class CredentialLookups:
    """Grouped :func:`~tuneplane.coordinator.store.identity.node_for_credential` on ``store``."""

    def __init__(self, store: Store) -> None:
        self._group: GroupWriter[str, NodeCredentialMatch | None] = GroupWriter(
            store, _matches, "credential lookup", reads_only=True
        )

    async def node_for_credential(self, credential_hash: str) -> NodeCredentialMatch | None:
        """The Node whose current or pending credential has this hash, or ``None``."""
        return await self._group.submit(credential_hash)


async def _matches(db: Handle, hashes: Sequence[str]) -> list[NodeCredentialMatch | None]:
    wanted = sorted(set(hashes))
    found: dict[str, NodeCredentialMatch] = {}
    step = IN_CHUNK // 2  # each hash is named twice
    for start in range(0, len(wanted), step):
        chunk = wanted[start : start + step]
        marks = ", ".join("?" for _ in chunk)
        rows = await db.execute_fetchall(
            f"{_COLUMNS}WHERE credential_hash IN ({marks}) OR next_credential_hash IN ({marks})",
            (*chunk, *chunk),
        )
        for r in rows:
            for presented in (str(r[4]), None if r[10] is None else str(r[10])):
                if presented in chunk and presented not in found:
                    found[presented] = _match(r, presented)
    return [found.get(h) for h in hashes]


def _match(r: Any, presented: str) -> NodeCredentialMatch:
    """As node_for_credential builds it from its row."""
    node = NodeRecord(str(r[0]), str(r[1]), str(r[2]), bool(r[3]))
    is_next = str(r[4]) != presented
    issued, expires = (r[7], r[8]) if is_next else (r[5], r[6])
    return NodeCredentialMatch(
        node, is_next, CredentialLife(_int(issued), _int(expires), _int(r[9]))
    )


def _int(value: Any) -> int | None:
    return None if value is None else int(value)
