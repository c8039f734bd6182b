"""The member journal: the agent's source of truth, one SQLite file (WAL, synchronous=FULL).

Rules:
- Every state change goes through :meth:`Journal.transition`, which checks it against the
  lifecycle table and commits the new state, its event row, the GPU ownership change and the
  report to the coordinator in ONE transaction, before the caller acts on it or acknowledges it.
- A member owns GPUs exactly while its state is in ``OWNS_GPUS``; ``gpu_ownership.gpu_uuid`` is
  unique (and, for a reservation an older agent made before UUIDs were journaled, which has
  uuid "", ``gpu_index``), so SQLite itself refuses a GPU owned twice.
- ``report_seq`` comes from a durable counter in ``meta``; it never goes back, across restarts.
  ``meta.journal_id`` is a random id made with the journal (or by the migration that added it):
  every report carries it, so a fresh journal's numbering is a new sequence, not a repeat.
- A member created or moved is noted in :attr:`~JournalDb.changes` once its transaction committed,
  so the loops that follow members re-read only what changed (agent/journal_changes.py).
The schema is documented in docs/journal.md; aiosqlite runs through :mod:`tuneplane.agent.adapter`.

:class:`Journal` is one class in layers, each its own module: :mod:`~tuneplane.agent.journal_db`
(the connection; opening and migrating it by :mod:`~tuneplane.agent.journal_schema`), then
:mod:`~tuneplane.agent.journal_gpus` (GPU ownership, XIDs, health events), then this module
(meta, node events, members and their transitions, reports). The values it returns and the
errors it raises are in :mod:`~tuneplane.agent.journal_records`.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

from .journal_db import fetchall, insert_event
from .journal_gpus import JournalGpus
from .journal_records import (
    AGENT_STARTED,
    AGENT_STOPPED,
    MEMBER_COLUMNS,
    REPORT_COLUMNS,
    REPORTED,
    Exit,
    ExtraEvent,
    GpuAlreadyOwned,
    MemberExists,
    MemberKey,
    MemberRecord,
    NewMember,
    PendingReport,
    PreviousStop,
    UnknownMember,
    judge_previous_stop,
    member_from_row,
    report_from_row,
)
from .member_state import OWNS_GPUS, TERMINAL, MemberEvent, MemberState, next_state

if TYPE_CHECKING:
    import aiosqlite


class Journal(JournalGpus):
    """The open journal. Create with :meth:`open` inside ``adapter.open_aio_host()``.

    Methods are Trio-async; each write is one SQLite transaction (see
    :class:`~tuneplane.agent.journal_db.JournalDb`).
    """

    # --- meta and credentials ----------------------------------------------------------------

    async def get_meta(self, key: str) -> str | None:
        rows = await self.read("SELECT value FROM meta WHERE key = ?", (key,))
        return str(rows[0][0]) if rows else None

    async def set_meta(self, key: str, value: str) -> None:
        async def fn(db: aiosqlite.Connection) -> None:
            await db.execute(
                "INSERT INTO meta (key, value) VALUES (?, ?) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (key, value),
            )

        await self.write(fn)

    async def record_credential(self, name: str, at_ms: int) -> None:
        """Note that credential ``name`` was issued (first) or rotated (later); never its value."""

        async def fn(db: aiosqlite.Connection) -> None:
            await db.execute(
                "INSERT INTO credentials (name, created_at_ms) VALUES (?, ?) "
                "ON CONFLICT (name) DO UPDATE SET rotated_at_ms = excluded.created_at_ms",
                (name, at_ms),
            )

        await self.write(fn)

    async def node_event(self, at_ms: int, kind: str, reason: str = "", **details: Any) -> None:
        """Append an event that concerns the Node, not one member (start, stop, safe mode)."""

        async def fn(db: aiosqlite.Connection) -> None:
            await insert_event(db, at_ms, None, kind, None, None, reason, details)

        await self.write(fn)

    async def record_start(
        self, at_ms: int, *, version: str, pid: int, state_dir: str
    ) -> PreviousStop:
        """Journal this daemon's start, with how the previous run ended, in one transaction."""
        found: list[PreviousStop] = []

        async def fn(db: aiosqlite.Connection) -> None:
            marker = await fetchall(
                db,
                "SELECT kind, at_ms FROM events WHERE member_key IS NULL AND kind IN (?, ?) "
                "ORDER BY id DESC LIMIT 1",
                (AGENT_STARTED, AGENT_STOPPED),
            )
            newest = await fetchall(db, "SELECT max(at_ms) FROM events")
            last_at = None if newest[0][0] is None else int(newest[0][0])
            previous = judge_previous_stop(
                str(marker[0][0]) if marker else None,
                int(marker[0][1]) if marker else None,
                last_at,
            )
            found.append(previous)
            await insert_event(
                db, at_ms, None, AGENT_STARTED, None, None, previous.sentence(),
                {
                    "version": version, "pid": pid, "state_dir": state_dir,
                    "previous_stop": previous.how,
                    "last_event_at_ms": previous.last_event_at_ms,
                    "stopped_at_ms": previous.stopped_at_ms,
                },
            )  # fmt: skip

        await self.write(fn)
        return found[0]

    async def member_event(
        self, key: MemberKey, at_ms: int, kind: str, reason: str = "", **details: Any
    ) -> None:
        """Append an event about one member that changes no state (a re-attach after restart)."""

        async def fn(db: aiosqlite.Connection) -> None:
            await insert_event(db, at_ms, str(key), kind, None, None, reason, details)

        await self.write(fn)

    # --- members -----------------------------------------------------------------------------

    async def member(self, key: MemberKey) -> MemberRecord | None:
        rows = await self.read(
            f"SELECT {MEMBER_COLUMNS} FROM members WHERE member_key = ?", (str(key),)
        )
        return member_from_row(rows[0]) if rows else None

    async def members(self) -> list[MemberRecord]:
        rows = await self.read(f"SELECT {MEMBER_COLUMNS} FROM members ORDER BY created_at_ms")
        return [member_from_row(r) for r in rows]

    async def members_of(
        self, states: Collection[MemberState], keys: Collection[MemberKey] = ()
    ) -> list[MemberRecord]:
        """The members in one of ``states`` or named in ``keys``, oldest first: what a loop
        re-reads each pass (SQLite filters the rows; ended members never become records)."""
        marks = ", ".join("?" * len(states))
        names = ", ".join("?" * len(keys))
        rows = await self.read(
            f"SELECT {MEMBER_COLUMNS} FROM members WHERE state IN ({marks}) "
            f"OR member_key IN ({names}) ORDER BY created_at_ms",
            [*(s.value for s in states), *map(str, keys)],
        )
        return [member_from_row(r) for r in rows]

    async def members_ended_after(self, event_id: int) -> tuple[list[MemberRecord], int]:
        """The members an event after ``event_id`` moved to an end state (0: every member that
        ended), oldest first, and the newest such event's id: passed back, it reads only the
        members ended since, a range of the events' primary key, never the whole history."""
        marks = ", ".join("?" * len(TERMINAL))
        rows = await self.read(
            f"SELECT {MEMBER_COLUMNS}, ended.last FROM members JOIN ("
            f"SELECT member_key, MAX(id) AS last FROM events WHERE id > ? "
            f"AND to_state IN ({marks}) GROUP BY member_key) AS ended USING (member_key) "
            f"ORDER BY created_at_ms",
            [event_id, *(s.value for s in TERMINAL)],
        )
        newest = max((int(r[-1]) for r in rows), default=event_id)
        return [member_from_row(r) for r in rows], newest

    async def create_member(self, new: NewMember, at_ms: int) -> MemberRecord:
        """Journal a member in ``preparing``. Raises :class:`MemberExists` on a repeat."""
        records: list[MemberRecord] = []

        async def fn(db: aiosqlite.Connection) -> None:
            try:
                # The record returned is the row as inserted: no read-back afterwards.
                inserted = await fetchall(
                    db,
                    "INSERT INTO members (member_key, run_id, attempt, member_index, state, "
                    "created_at_ms, updated_at_ms, member_count, gpu_indexes, member_dir, "
                    "out_dir, grace_period_s, gpu_uuids) "
                    f"VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING {MEMBER_COLUMNS}",
                    (
                        str(new.key),
                        new.key.run_id,
                        new.key.attempt,
                        new.key.member_index,
                        MemberState.PREPARING.value,
                        at_ms,
                        at_ms,
                        new.member_count,
                        json.dumps(list(new.gpu_indexes)),
                        new.member_dir,
                        new.out_dir,
                        new.grace_period_s,
                        json.dumps(list(new.gpu_uuids)),
                    ),
                )
            except sqlite3.IntegrityError:
                raise MemberExists(f"Member {new.key} is already in the journal.") from None
            records.append(member_from_row(inserted[0]))
            await insert_event(
                db,
                at_ms,
                str(new.key),
                "prepare-received",
                None,
                MemberState.PREPARING.value,
                "",
                {
                    "gpu_indexes": list(new.gpu_indexes),
                    "gpu_uuids": list(new.gpu_uuids),
                    "member_count": new.member_count,
                },
            )

        await self.write(fn)
        self.changes.note(new.key)
        return records[0]

    async def transition(
        self,
        key: MemberKey,
        event: MemberEvent,
        at_ms: int,
        *,
        reason: str = "",
        exit: Exit | None = None,
        rendezvous: tuple[str, int] | None = None,
        details: Mapping[str, Any] | None = None,
        extra: ExtraEvent | None = None,
        manifest: str = "",
    ) -> tuple[MemberRecord, PendingReport | None]:
        """Apply ``event`` to the member and commit everything that follows from it at once.

        Raises :class:`UnknownMember`, :class:`IllegalTransition` (nothing written), or
        :class:`GpuAlreadyOwned` when entering ``prepared`` would own a GPU twice (nothing
        written). Returns the new record and the report queued for the coordinator, if any.
        ``extra`` is one more event row on the member, written first in the same transaction
        (an ``exit-collected`` note before the ``exit-observed`` it explains). ``manifest`` is
        the member's output manifest summary (JSON), kept in the event's details and sent with
        the report.
        """
        reports: list[PendingReport] = []
        records: list[MemberRecord] = []

        async def fn(db: aiosqlite.Connection) -> None:
            rows = await fetchall(
                db, f"SELECT {MEMBER_COLUMNS} FROM members WHERE member_key = ?", (str(key),)
            )
            if not rows:
                raise UnknownMember(f"Member {key} is not in the journal.")
            before = member_from_row(rows[0])
            after = next_state(before.state, event)
            sets = ["state = ?", "updated_at_ms = ?"]
            args: list[Any] = [after.value, at_ms]
            if reason:
                sets.append("reason = ?")
                args.append(reason)
            if exit is not None:
                sets += ["exit_code = ?", "signal = ?"]
                args += [exit.exit_code, exit.signal]
            if rendezvous is not None:
                sets += ["master_addr = ?", "master_port = ?"]
                args += [rendezvous[0], rendezvous[1]]
            # The record after the change, as the row now reads: no read-back afterwards.
            updated = await fetchall(
                db,
                f"UPDATE members SET {', '.join(sets)} WHERE member_key = ? "
                f"RETURNING {MEMBER_COLUMNS}",
                [*args, str(key)],
            )
            records.append(member_from_row(updated[0]))
            if extra is not None:
                await insert_event(
                    db, at_ms, str(key), extra.kind, None, None, extra.reason, extra.details
                )
            event_details = dict(details or {})
            if exit is not None:
                event_details.update(exit_code=exit.exit_code, signal=exit.signal)
            if manifest:
                event_details["output_manifest"] = json.loads(manifest)
            await insert_event(
                db, at_ms, str(key), event.value, before.state.value, after.value, reason,
                event_details,
            )  # fmt: skip
            if after in OWNS_GPUS and before.state not in OWNS_GPUS:
                for gpu, uuid in _gpus_of(before):
                    try:
                        await db.execute(
                            "INSERT INTO gpu_ownership (gpu_uuid, gpu_index, member_key, "
                            "since_ms) VALUES (?, ?, ?, ?)",
                            (uuid, gpu, str(key), at_ms),
                        )
                    except sqlite3.IntegrityError:
                        owner = await fetchall(
                            db,
                            "SELECT member_key FROM gpu_ownership WHERE (gpu_uuid = ? AND "
                            "gpu_uuid != '') OR (gpu_uuid = '' AND gpu_index = ?)",
                            (uuid, gpu),
                        )
                        who = owner[0][0] if owner else "this same member (listed twice)"
                        name = f"GPU {gpu} ({uuid})" if uuid else f"GPU {gpu}"
                        raise GpuAlreadyOwned(
                            f"{name} is already owned by member {who}; it cannot be assigned "
                            f"to member {key}."
                        ) from None
            elif after not in OWNS_GPUS:
                await db.execute("DELETE FROM gpu_ownership WHERE member_key = ?", (str(key),))
            if after in REPORTED:
                # The meta row keeps the next number as text; it is counted up in place.
                seq_rows = await fetchall(
                    db,
                    "UPDATE meta SET value = CAST(CAST(value AS INTEGER) + 1 AS TEXT) "
                    "WHERE key = 'next_report_seq' RETURNING value",
                )
                seq = int(seq_rows[0][0]) - 1
                row = (
                    seq,
                    str(key),
                    after.value,
                    at_ms,
                    reason,
                    int(exit is not None),
                    (exit.exit_code or 0) if exit else 0,
                    (exit.signal or 0) if exit else 0,
                    before.out_dir,
                    manifest,
                )
                await db.execute(
                    f"INSERT INTO pending_reports ({REPORT_COLUMNS}) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    row,
                )
                reports.append(report_from_row(row, self.journal_id))

        await self.write(fn)
        self.changes.note(key)
        record = records[0]
        # The report is built from what the transaction wrote, not read back: once committed,
        # the session may already have sent it, had it acknowledged and deleted the row.
        return record, (reports[0] if reports else None)

    # --- reports -----------------------------------------------------------------------------

    async def pending_reports(self) -> list[PendingReport]:
        """Every report the coordinator has not acknowledged, oldest first."""
        rows = await self.read(f"SELECT {REPORT_COLUMNS} FROM pending_reports ORDER BY report_seq")
        return [report_from_row(r, self.journal_id) for r in rows]

    async def counts(self) -> tuple[dict[str, int], int]:
        """Members by state, and how many reports wait for acknowledgement (two COUNTs)."""
        members = await self.read("SELECT state, COUNT(*) FROM members GROUP BY state")
        pending = await self.read("SELECT COUNT(*) FROM pending_reports")
        return {str(state): int(n) for state, n in members}, int(pending[0][0])

    async def ack_report(self, report_seq: int, refused: str = "", at_ms: int = 0) -> bool:
        """Drop an acknowledged report. A repeated or unknown acknowledgement is harmless.

        ``refused`` is the coordinator's sentence when it would not apply the report: the report
        is dropped all the same (resending cannot change the answer) and the refusal is kept as
        a ``report-refused`` event on the member, in the same transaction.
        """
        gone: list[int] = []

        async def fn(db: aiosqlite.Connection) -> None:
            rows = await fetchall(
                db, "SELECT member_key, state FROM pending_reports WHERE report_seq = ?",
                (report_seq,),
            )  # fmt: skip
            cursor = await db.execute(
                "DELETE FROM pending_reports WHERE report_seq = ?", (report_seq,)
            )
            gone.append(cursor.rowcount)
            await cursor.close()
            if refused and rows:
                member_key, state = rows[0]
                await insert_event(
                    db, at_ms, member_key, "report-refused", None, None, refused,
                    {"report_seq": report_seq, "state": state},
                )  # fmt: skip

        await self.write(fn)
        return bool(gone and gone[0])

    async def events(self, member: MemberKey | None = None) -> list[dict[str, Any]]:
        sql = (
            "SELECT id, at_ms, member_key, kind, from_state, to_state, reason, details FROM events"
        )
        args: tuple[Any, ...] = ()
        if member is not None:
            sql += " WHERE member_key = ?"
            args = (str(member),)
        rows = await self.read(sql + " ORDER BY id", args)
        names = ("id", "at_ms", "member_key", "kind", "from_state", "to_state", "reason")
        return [dict(zip(names, r[:7], strict=True), details=json.loads(r[7])) for r in rows]


def _gpus_of(record: MemberRecord) -> list[tuple[int, str]]:
    """(index, uuid) of each of a member's GPUs; uuid "" where the journal has none."""
    uuids = record.gpu_uuids or ("",) * len(record.gpu_indexes)
    return list(zip(record.gpu_indexes, uuids, strict=True))
