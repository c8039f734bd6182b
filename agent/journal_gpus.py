"""The journal's GPUs: who owns each (by UUID, by index for old reservations), the XIDs the
driver reported and the health events that judged or cleared them.

Rules: a GPU is owned through ``gpu_ownership``, written only by
:meth:`~tuneplane.agent.journal.Journal.transition`; here it is read, and filled in by UUID for
members an older agent prepared. XIDs (``gpu_xids``) and what cleared them
(``gpu_health_events``) are rows judged by :mod:`tuneplane.agent.xid_book`; the operator's
``tuneplane-node gpu clear`` writes here while the daemon runs (SQLite serialises the two
writers; the daemon reads the rows back).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .inventory import Inventory
from .journal_db import JournalDb, fetchall, insert_event, insert_health
from .journal_records import (
    HEALTH_COLUMNS,
    MEMBER_COLUMNS,
    XID_COLUMNS,
    MemberKey,
    health_from_row,
    member_from_row,
    xid_from_row,
)
from .member_state import TERMINAL
from .xid_book import NewHealthEvent, NewXid, XidBook, XidRecord

if TYPE_CHECKING:
    import aiosqlite


class JournalGpus(JournalDb):
    """The journal's GPU ownership reads and its XID and GPU health rows."""

    # --- GPU ownership -----------------------------------------------------------------------

    async def gpu_owners(self) -> dict[int, MemberKey]:
        """Owners by the index each reservation was made at (for reading; decide by UUID)."""
        rows = await self.read("SELECT gpu_index, member_key FROM gpu_ownership")
        return {int(r[0]): MemberKey.parse(r[1]) for r in rows}

    async def gpu_owners_by_uuid(self) -> tuple[dict[str, MemberKey], dict[int, MemberKey]]:
        """Owners by GPU UUID, and by index for the reservations that have no UUID ("")."""
        rows = await self.read("SELECT gpu_uuid, gpu_index, member_key FROM gpu_ownership")
        named = {str(r[0]): MemberKey.parse(r[2]) for r in rows if r[0]}
        unnamed = {int(r[1]): MemberKey.parse(r[2]) for r in rows if not r[0]}
        return named, unnamed

    async def fill_member_uuids(self, inventory: Inventory, at_ms: int) -> list[MemberKey]:
        """Give members an older agent prepared (no UUIDs journaled) the UUIDs of their GPUs.

        Only members that have not ended are filled, from ``inventory`` as it is now (the
        first inventory after the upgrade, before any member launches). A GPU index the
        inventory lacks keeps uuid "" and its reservation stays by index; the member's event
        says so. Returns the members changed.
        """
        changed: list[MemberKey] = []

        async def fn(db: aiosqlite.Connection) -> None:
            rows = await fetchall(db, f"SELECT {MEMBER_COLUMNS} FROM members")
            for record in map(member_from_row, rows):
                if record.gpu_uuids or not record.gpu_indexes or record.state in TERMINAL:
                    continue
                uuids = []
                missing = []
                for index in record.gpu_indexes:
                    gpu = inventory.gpu(index)
                    uuids.append(gpu.uuid if gpu is not None else "")
                    if gpu is None:
                        missing.append(index)
                await db.execute(
                    "UPDATE members SET gpu_uuids = ? WHERE member_key = ?",
                    (json.dumps(uuids), str(record.key)),
                )
                for index, uuid in zip(record.gpu_indexes, uuids, strict=True):
                    if uuid:
                        await db.execute(
                            "UPDATE gpu_ownership SET gpu_uuid = ? WHERE member_key = ? AND "
                            "gpu_index = ? AND gpu_uuid = ''",
                            (uuid, str(record.key), index),
                        )
                note = (
                    f"GPU {', '.join(map(str, missing))} not in the inventory "
                    f"({inventory.gpu_source}); kept by index with uuid ''"
                    if missing
                    else ""
                )
                await insert_event(
                    db, at_ms, str(record.key), "gpu-uuids-filled", None, None, note,
                    {"gpu_indexes": list(record.gpu_indexes), "gpu_uuids": uuids},
                )  # fmt: skip
                changed.append(record.key)

        await self.write(fn)
        return changed

    # --- GPU health: XIDs and clears -----------------------------------------------------------

    #: The last book read and the ``data_version`` it was read at; None after a write here.
    _xid_cache: tuple[int, XidBook] | None = None

    async def xid_book(self) -> XidBook:
        """Every XID and GPU health event in the journal, as the book that judges them.

        Every inventory refresh (and every launch) asks; the rows are read again only when they
        may have changed: this journal's own writes to them drop the cached book, and SQLite's
        ``data_version`` moves when another process (``tuneplane-node gpu clear``) committed.
        """
        seen = self._xid_cache[0] if self._xid_cache is not None else None
        version, rows = await self.read_if_changed(
            (
                f"SELECT {XID_COLUMNS} FROM gpu_xids ORDER BY id",
                f"SELECT {HEALTH_COLUMNS} FROM gpu_health_events ORDER BY id",
            ),
            seen,
        )
        if rows is None and self._xid_cache is not None:
            return self._xid_cache[1]
        if rows is None:
            # Dropped by a write of ours meanwhile: read again, whatever the version says.
            return await self.xid_book()
        xids, events = rows
        book = XidBook.of(map(xid_from_row, xids), map(health_from_row, events))
        self._xid_cache = (version, book)
        return book

    async def record_xids(self, xids: Sequence[NewXid]) -> list[XidRecord]:
        """Journal XIDs drained from NVML, in one transaction; returns them with their ids."""
        written: list[XidRecord] = []

        async def fn(db: aiosqlite.Connection) -> None:
            for x in xids:
                cursor = await db.execute(
                    "INSERT INTO gpu_xids (gpu_uuid, xid, at_ms, application) VALUES (?, ?, ?, ?)",
                    (x.uuid, x.xid, x.at_ms, int(x.application)),
                )
                row_id = cursor.lastrowid
                await cursor.close()
                assert row_id is not None
                written.append(XidRecord(row_id, x.uuid, x.xid, x.at_ms, x.application))

        if xids:
            self._xid_cache = None
            await self.write(fn)
            self._xid_cache = None
        return written

    async def record_health_events(self, rows: Sequence[NewHealthEvent]) -> None:
        """Journal GPU health events (clears, recovery-action changes) in one transaction."""

        async def fn(db: aiosqlite.Connection) -> None:
            for r in rows:
                await insert_health(db, r)

        if rows:
            self._xid_cache = None
            await self.write(fn)
            self._xid_cache = None

    async def clear_gpu(self, uuid: str, at_ms: int, actor: str, reason: str) -> XidRecord | None:
        """Journal an operator clear of every XID of ``uuid`` so far; return the one it lifted.

        Read and written in one transaction, so an XID the daemon journals meanwhile is either
        covered (written before) or not (after), never half. When no XID disables ``uuid``
        nothing is written and None is returned.
        """
        lifted: list[XidRecord | None] = []

        async def fn(db: aiosqlite.Connection) -> None:
            xids = await fetchall(db, f"SELECT {XID_COLUMNS} FROM gpu_xids ORDER BY id")
            events = await fetchall(
                db, f"SELECT {HEALTH_COLUMNS} FROM gpu_health_events ORDER BY id"
            )
            book = XidBook.of(map(xid_from_row, xids), map(health_from_row, events))
            row, was = book.clear(uuid, at_ms, actor, reason)
            if was is not None:
                await insert_health(db, row)
            lifted.append(was)

        self._xid_cache = None
        await self.write(fn)
        self._xid_cache = None
        return lifted[0]
