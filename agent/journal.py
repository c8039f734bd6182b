"""The member journal: the agent's source of truth, one SQLite file (WAL, synchronous=FULL).

Rules:
- Every state change goes through :meth:`Journal.transition`, which checks it against the
  lifecycle table and commits the new state, its event row, the GPU ownership change and the
  report to the coordinator in ONE transaction, before the caller acts on it or acknowledges it.
- A member owns GPUs exactly while its state is in ``OWNS_GPUS``; ``gpu_ownership.gpu_uuid`` is
  unique (and, for a reservation an older agent made before UUIDs were journaled, which has
  uuid "", ``gpu_index``), so SQLite itself refuses a GPU owned twice.
- XIDs (``gpu_xids``) and what cleared them (``gpu_health_events``) are rows judged by
  :mod:`tuneplane.agent.xid_book`; the operator's ``tuneplane-node gpu clear`` writes here while
  the daemon runs (SQLite serialises the two writers; the daemon reads the rows back).
- ``report_seq`` comes from a durable counter in ``meta``; it never goes back, across restarts.
  ``meta.journal_id`` is a random id made with the journal (or by the migration that added it):
  every report carries it, so a fresh journal's numbering is a new sequence, not a repeat.
The schema is documented in docs/journal.md; aiosqlite runs through :mod:`tuneplane.agent.adapter`.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiosqlite
import attrs
import trio

from .adapter import run_aio
from .inventory import Inventory
from .member_state import (
    OWNS_GPUS,
    TERMINAL,
    MemberEvent,
    MemberState,
    next_state,
)
from .xid_book import HealthEvent, NewHealthEvent, NewXid, XidBook, XidRecord

log = logging.getLogger(__name__)

SCHEMA_VERSION = 4

# Migration n brings a journal from version n-1 to n. Append only; never edit a shipped one.
MIGRATIONS: Sequence[str] = (
    """
    CREATE TABLE meta (
        key TEXT PRIMARY KEY,
        value TEXT NOT NULL
    );
    CREATE TABLE members (
        member_key TEXT PRIMARY KEY,
        run_id TEXT NOT NULL,
        attempt INTEGER NOT NULL,
        member_index INTEGER NOT NULL,
        state TEXT NOT NULL,
        created_at_ms INTEGER NOT NULL,
        updated_at_ms INTEGER NOT NULL,
        member_count INTEGER NOT NULL,
        gpu_indexes TEXT NOT NULL,
        master_addr TEXT NOT NULL DEFAULT '',
        master_port INTEGER NOT NULL DEFAULT 0,
        member_dir TEXT NOT NULL,
        out_dir TEXT NOT NULL,
        grace_period_s INTEGER NOT NULL,
        exit_code INTEGER,
        signal INTEGER,
        reason TEXT NOT NULL DEFAULT ''
    );
    CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        at_ms INTEGER NOT NULL,
        member_key TEXT,
        kind TEXT NOT NULL,
        from_state TEXT,
        to_state TEXT,
        reason TEXT NOT NULL DEFAULT '',
        details TEXT NOT NULL DEFAULT '{}'
    );
    CREATE INDEX events_member ON events (member_key, id);
    CREATE TABLE gpu_ownership (
        gpu_index INTEGER PRIMARY KEY,
        member_key TEXT NOT NULL REFERENCES members (member_key),
        since_ms INTEGER NOT NULL
    );
    CREATE TABLE pending_reports (
        report_seq INTEGER PRIMARY KEY,
        member_key TEXT NOT NULL REFERENCES members (member_key),
        state TEXT NOT NULL,
        at_ms INTEGER NOT NULL,
        reason TEXT NOT NULL DEFAULT '',
        has_exit INTEGER NOT NULL DEFAULT 0,
        exit_code INTEGER NOT NULL DEFAULT 0,
        signal INTEGER NOT NULL DEFAULT 0,
        out_dir TEXT NOT NULL DEFAULT ''
    );
    CREATE TABLE credentials (
        name TEXT PRIMARY KEY,
        created_at_ms INTEGER NOT NULL,
        rotated_at_ms INTEGER
    );
    INSERT INTO meta (key, value) VALUES ('next_report_seq', '1');
    """,
    # 2: the journal's identity. Random, made once, here: a new journal gets it as it is created
    # (after migration 1) and an existing one as it is opened by this agent for the first time.
    """
    INSERT INTO meta (key, value) VALUES ('journal_id', lower(hex(randomblob(16))));
    """,
    # 3: GPUs by UUID, and what the driver said about them. Reservations are keyed by the GPU's
    # UUID (the index is kept for reading); rows an older agent wrote get uuid "" and stay
    # unique by index until the daemon fills them in from its inventory (fill_member_uuids).
    """
    CREATE TABLE gpu_ownership_v3 (
        gpu_uuid TEXT NOT NULL,
        gpu_index INTEGER NOT NULL,
        member_key TEXT NOT NULL REFERENCES members (member_key),
        since_ms INTEGER NOT NULL
    );
    INSERT INTO gpu_ownership_v3 (gpu_uuid, gpu_index, member_key, since_ms)
        SELECT '', gpu_index, member_key, since_ms FROM gpu_ownership;
    DROP TABLE gpu_ownership;
    ALTER TABLE gpu_ownership_v3 RENAME TO gpu_ownership;
    CREATE UNIQUE INDEX gpu_ownership_uuid ON gpu_ownership (gpu_uuid) WHERE gpu_uuid != '';
    CREATE UNIQUE INDEX gpu_ownership_unnamed ON gpu_ownership (gpu_index) WHERE gpu_uuid = '';
    CREATE INDEX gpu_ownership_member ON gpu_ownership (member_key);
    ALTER TABLE members ADD COLUMN gpu_uuids TEXT NOT NULL DEFAULT '[]';
    CREATE TABLE gpu_xids (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        gpu_uuid TEXT NOT NULL,
        xid INTEGER NOT NULL,
        at_ms INTEGER NOT NULL,
        application INTEGER NOT NULL
    );
    CREATE INDEX gpu_xids_uuid ON gpu_xids (gpu_uuid, id);
    CREATE TABLE gpu_health_events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        gpu_uuid TEXT NOT NULL,
        at_ms INTEGER NOT NULL,
        kind TEXT NOT NULL,
        actor TEXT NOT NULL,
        reason TEXT NOT NULL DEFAULT '',
        through_xid_id INTEGER NOT NULL DEFAULT 0,
        recovery_action TEXT NOT NULL DEFAULT ''
    );
    CREATE INDEX gpu_health_events_uuid ON gpu_health_events (gpu_uuid, id);
    """,
    # 4: an ended member's output manifest, as the exit report carries it to the coordinator
    # (ManifestSummary JSON: files, bytes, sha256 of the manifest file, or the problem that
    # kept it from being written); '' on every other report.
    """
    ALTER TABLE pending_reports ADD COLUMN manifest TEXT NOT NULL DEFAULT '';
    """,
)

#: Member states the coordinator hears about through MemberReport. Prepared and a refused
#: prepare are answered by PrepareReply instead.
REPORTED: frozenset[MemberState] = frozenset(
    {
        MemberState.COMMITTED,
        MemberState.STARTING,
        MemberState.RUNNING,
        MemberState.CANCELLING,
        MemberState.EXITED,
        MemberState.ABORTED,
        MemberState.LOST,
    }
)


class JournalError(Exception):
    """The journal cannot do what was asked. ``str()`` is a sentence for the operator."""


class JournalCorrupt(JournalError):
    """The journal file failed its integrity check: the agent must enter safe mode."""


class JournalTooNew(JournalError):
    """The journal was written by a newer agent whose schema this one does not know."""


class UnknownMember(JournalError):
    """A transition names a member the journal has never recorded."""


class MemberExists(JournalError):
    """A Prepare for a member that is already in the journal (repeats are answered, not redone)."""


class GpuAlreadyOwned(JournalError):
    """A GPU asked for is owned by another member (or does not appear twice in one request)."""


#: Node events (``member_key`` NULL) that bracket one run of the daemon. ``agent-stopped`` is
#: written, committed and fsynced at an orderly stop (SIGTERM, SIGINT) and at nothing else, so
#: an ``agent-started`` with no ``agent-stopped`` after it means the daemon did not stop in order.
AGENT_STARTED = "agent-started"
AGENT_STOPPED = "agent-stopped"
#: Member events written on a restart: a live runner found again, and an exit found on disk.
MEMBER_REATTACHED = "member-reattached"
EXIT_COLLECTED = "exit-collected"
# The coordinator named a new control address; node.json now dials it first (details: old, new).
CONTROL_ADDRESS_CHANGED = "control-address-changed"
AGENT_FAILED = "agent-failed"
#: Every event kind this agent writes (the lifecycle's, then the others), so a reader can tell a
#: kind that has not happened yet from a typo.
EVENT_KINDS: frozenset[str] = frozenset(e.value for e in MemberEvent) | {
    "prepare-received", "report-refused", "gpu-uuids-filled", MEMBER_REATTACHED, EXIT_COLLECTED,
    AGENT_STARTED, AGENT_STOPPED, AGENT_FAILED, "enrolled", "re-enrolled", "journal-created",
}  # fmt: skip


@attrs.frozen
class PreviousStop:
    """How the daemon's previous run ended, as the journal shows it at this start.

    ``how`` is ``first`` (no earlier start in this journal), ``clean`` (an orderly stop was
    journaled) or ``unclean`` (a crash, kill -9 or power loss: the last start has no stop).
    ``last_event_at_ms`` is the newest event before this start (for ``unclean``, the last thing
    the previous run wrote); ``stopped_at_ms`` the orderly stop, when there was one.
    """

    how: str
    last_event_at_ms: int | None
    stopped_at_ms: int | None

    def sentence(self) -> str:
        if self.how == "first":
            return "first start with this journal"
        if self.how == "clean":
            return f"the previous run stopped cleanly at {_utc(self.stopped_at_ms)}"
        return (
            "the previous run did not stop cleanly (a crash, kill -9 or power loss); the last "
            f"event it journaled was at {_utc(self.last_event_at_ms)}"
        )


def judge_previous_stop(
    last_marker: str | None, marker_at_ms: int | None, last_event_at_ms: int | None
) -> PreviousStop:
    """Classify the previous stop from the newest start/stop marker and the newest event."""
    if last_marker is None:
        return PreviousStop("first", last_event_at_ms, None)
    if last_marker == AGENT_STOPPED:
        return PreviousStop("clean", last_event_at_ms, marker_at_ms)
    return PreviousStop("unclean", last_event_at_ms, None)


def _utc(at_ms: int | None) -> str:
    if at_ms is None:
        return "an unknown time"
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at_ms / 1000))


@attrs.frozen
class ExtraEvent:
    """One more event row a transition writes in its own transaction (same member)."""

    kind: str
    reason: str
    details: Mapping[str, Any]


@attrs.frozen
class MemberKey:
    """One member of one attempt of one Job; ``str()`` is its journal and directory name."""

    run_id: str
    attempt: int
    member_index: int

    def __str__(self) -> str:
        return f"{self.run_id}.{self.attempt}.{self.member_index}"

    @classmethod
    def parse(cls, text: str) -> MemberKey:
        """Read ``<run id>.<attempt>.<member>`` (the run id may itself contain dots)."""
        run_id, _, rest = text.rpartition(".")
        run_id, _, attempt = run_id.rpartition(".")
        if not run_id or not attempt.isdigit() or not rest.isdigit():
            raise ValueError(
                f"member '{text}' is not of the form <run id>.<attempt>.<member index>; "
                "copy it from `tuneplane-node journal members`."
            )
        return cls(run_id, int(attempt), int(rest))


@attrs.frozen
class Exit:
    """How a member's runner ended: an exit code, or the signal that killed the workload."""

    exit_code: int | None
    signal: int | None


@attrs.frozen
class MemberRecord:
    key: MemberKey
    state: MemberState
    created_at_ms: int
    updated_at_ms: int
    member_count: int
    gpu_indexes: tuple[int, ...]
    master_addr: str
    master_port: int
    member_dir: str
    out_dir: str
    grace_period_s: int
    exit: Exit | None
    reason: str
    # The UUIDs of ``gpu_indexes``, in the same order; () for a member an older agent prepared
    # whose GPUs were not in the inventory when this agent first opened the journal.
    gpu_uuids: tuple[str, ...] = ()


@attrs.frozen
class PendingReport:
    report_seq: int
    key: MemberKey
    state: MemberState
    at_ms: int
    reason: str
    exit: Exit | None
    out_dir: str
    journal_id: str = ""  # the journal that numbered it (``meta.journal_id``)
    # The member's output manifest summary (ManifestSummary JSON) on its exit report; "" else.
    manifest: str = ""


@attrs.frozen
class NewMember:
    """What a Prepare asks for, as the journal records it in ``preparing``."""

    key: MemberKey
    member_count: int
    gpu_indexes: tuple[int, ...]
    member_dir: str
    out_dir: str
    grace_period_s: int
    # The UUIDs of ``gpu_indexes`` as the inventory named them at Prepare, in the same order.
    gpu_uuids: tuple[str, ...] = ()


MEMBER_COLUMNS = (
    "member_key, run_id, attempt, member_index, state, created_at_ms, updated_at_ms, "
    "member_count, gpu_indexes, master_addr, master_port, member_dir, out_dir, grace_period_s, "
    "exit_code, signal, reason, gpu_uuids"
)
XID_COLUMNS = "id, gpu_uuid, xid, at_ms, application"
HEALTH_COLUMNS = "id, gpu_uuid, at_ms, kind, actor, reason, through_xid_id, recovery_action"
REPORT_COLUMNS = (
    "report_seq, member_key, state, at_ms, reason, has_exit, exit_code, signal, out_dir, manifest"
)


def member_from_row(row: Sequence[Any]) -> MemberRecord:
    """A ``members`` row (selected as :data:`MEMBER_COLUMNS`) as a record."""
    exit_code, sig = row[14], row[15]
    return MemberRecord(
        key=MemberKey(row[1], int(row[2]), int(row[3])),
        state=MemberState(row[4]),
        created_at_ms=int(row[5]),
        updated_at_ms=int(row[6]),
        member_count=int(row[7]),
        gpu_indexes=tuple(int(i) for i in json.loads(row[8])),
        master_addr=row[9],
        master_port=int(row[10]),
        member_dir=row[11],
        out_dir=row[12],
        grace_period_s=int(row[13]),
        exit=None if exit_code is None and sig is None else Exit(exit_code, sig),
        reason=row[16],
        gpu_uuids=tuple(str(u) for u in json.loads(row[17])),
    )


def xid_from_row(row: Sequence[Any]) -> XidRecord:
    """A ``gpu_xids`` row (selected as :data:`XID_COLUMNS`) as a record."""
    return XidRecord(int(row[0]), str(row[1]), int(row[2]), int(row[3]), bool(row[4]))


def health_from_row(row: Sequence[Any]) -> HealthEvent:
    """A ``gpu_health_events`` row (selected as :data:`HEALTH_COLUMNS`) as a record."""
    return HealthEvent(
        int(row[0]), str(row[1]), int(row[2]), str(row[3]), str(row[4]), str(row[5]),
        int(row[6]), str(row[7]),
    )  # fmt: skip


def report_from_row(row: Sequence[Any], journal_id: str = "") -> PendingReport:
    """A ``pending_reports`` row (selected as :data:`REPORT_COLUMNS`) as a record."""
    has_exit = bool(row[5])
    return PendingReport(
        journal_id=journal_id,
        report_seq=int(row[0]),
        key=MemberKey.parse(row[1]),
        state=MemberState(row[2]),
        at_ms=int(row[3]),
        reason=row[4],
        exit=Exit(row[6] if not row[7] else None, row[7] or None) if has_exit else None,
        out_dir=row[8],
        manifest=str(row[9] or "") if len(row) > 9 else "",
    )


async def _fetchall(db: aiosqlite.Connection, sql: str, args: Sequence[Any] = ()) -> list[Any]:
    cursor = await db.execute(sql, args)
    rows = await cursor.fetchall()
    await cursor.close()
    return list(rows)


class Journal:
    """The open journal. Create with :meth:`open` inside ``adapter.open_aio_host()``.

    Methods are Trio-async; each write is one SQLite transaction, serialised by a lock and shielded
    from cancellation so a cancelled caller never leaves a half-written transaction behind.
    """

    def __init__(self, db: aiosqlite.Connection, path: Path, journal_id: str = "") -> None:
        self._db = db
        self.path = path
        self._lock = trio.Lock()
        #: This journal's random identity (``meta.journal_id``), sent with every report.
        self.journal_id = journal_id
        #: Told the seconds each write's COMMIT (its fsync) took; the daemon's metrics set it.
        self.on_commit: Callable[[float], None] | None = None

    # --- opening -----------------------------------------------------------------------------

    @classmethod
    async def open(cls, path: Path) -> Journal:
        """Open (creating if absent), check integrity, and migrate the journal at ``path``.

        Raises :class:`JournalCorrupt` when the file is not a sound SQLite database, and
        :class:`JournalTooNew` when its schema is newer than this agent knows.
        """
        db = await run_aio(_aio_open, path)
        rows = await run_aio(_fetchall, db, "SELECT value FROM meta WHERE key = 'journal_id'")
        return cls(db, path, str(rows[0][0]))

    async def close(self) -> None:
        async with self._lock:
            with trio.CancelScope(shield=True):
                await run_aio(self._db.close)

    async def _read(self, sql: str, args: Sequence[Any] = ()) -> list[Any]:
        async with self._lock:
            return await run_aio(_fetchall, self._db, sql, args)

    async def _write(self, fn: Any, *args: Any) -> Any:
        async with self._lock:
            with trio.CancelScope(shield=True):
                return await run_aio(
                    _aio_transaction, self._db, fn, *args, on_commit=self.on_commit
                )

    # --- meta and credentials ----------------------------------------------------------------

    async def get_meta(self, key: str) -> str | None:
        rows = await self._read("SELECT value FROM meta WHERE key = ?", (key,))
        return str(rows[0][0]) if rows else None

    async def set_meta(self, key: str, value: str) -> None:
        async def fn(db: aiosqlite.Connection) -> None:
            await db.execute(
                "INSERT INTO meta (key, value) VALUES (?, ?) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (key, value),
            )

        await self._write(fn)

    async def record_credential(self, name: str, at_ms: int) -> None:
        """Note that credential ``name`` was issued (first) or rotated (later); never its value."""

        async def fn(db: aiosqlite.Connection) -> None:
            await db.execute(
                "INSERT INTO credentials (name, created_at_ms) VALUES (?, ?) "
                "ON CONFLICT (name) DO UPDATE SET rotated_at_ms = excluded.created_at_ms",
                (name, at_ms),
            )

        await self._write(fn)

    async def node_event(self, at_ms: int, kind: str, reason: str = "", **details: Any) -> None:
        """Append an event that concerns the Node, not one member (start, stop, safe mode)."""

        async def fn(db: aiosqlite.Connection) -> None:
            await _insert_event(db, at_ms, None, kind, None, None, reason, details)

        await self._write(fn)

    async def record_start(
        self, at_ms: int, *, version: str, pid: int, state_dir: str
    ) -> PreviousStop:
        """Journal this daemon's start, with how the previous run ended, in one transaction."""
        found: list[PreviousStop] = []

        async def fn(db: aiosqlite.Connection) -> None:
            marker = await _fetchall(
                db,
                "SELECT kind, at_ms FROM events WHERE member_key IS NULL AND kind IN (?, ?) "
                "ORDER BY id DESC LIMIT 1",
                (AGENT_STARTED, AGENT_STOPPED),
            )
            newest = await _fetchall(db, "SELECT max(at_ms) FROM events")
            last_at = None if newest[0][0] is None else int(newest[0][0])
            previous = judge_previous_stop(
                str(marker[0][0]) if marker else None,
                int(marker[0][1]) if marker else None,
                last_at,
            )
            found.append(previous)
            await _insert_event(
                db, at_ms, None, AGENT_STARTED, None, None, previous.sentence(),
                {
                    "version": version, "pid": pid, "state_dir": state_dir,
                    "previous_stop": previous.how,
                    "last_event_at_ms": previous.last_event_at_ms,
                    "stopped_at_ms": previous.stopped_at_ms,
                },
            )  # fmt: skip

        await self._write(fn)
        return found[0]

    async def member_event(
        self, key: MemberKey, at_ms: int, kind: str, reason: str = "", **details: Any
    ) -> None:
        """Append an event about one member that changes no state (a re-attach after restart)."""

        async def fn(db: aiosqlite.Connection) -> None:
            await _insert_event(db, at_ms, str(key), kind, None, None, reason, details)

        await self._write(fn)

    # --- members -----------------------------------------------------------------------------

    async def member(self, key: MemberKey) -> MemberRecord | None:
        rows = await self._read(
            f"SELECT {MEMBER_COLUMNS} FROM members WHERE member_key = ?", (str(key),)
        )
        return member_from_row(rows[0]) if rows else None

    async def members(self) -> list[MemberRecord]:
        rows = await self._read(f"SELECT {MEMBER_COLUMNS} FROM members ORDER BY created_at_ms")
        return [member_from_row(r) for r in rows]

    async def gpu_owners(self) -> dict[int, MemberKey]:
        """Owners by the index each reservation was made at (for reading; decide by UUID)."""
        rows = await self._read("SELECT gpu_index, member_key FROM gpu_ownership")
        return {int(r[0]): MemberKey.parse(r[1]) for r in rows}

    async def gpu_owners_by_uuid(self) -> tuple[dict[str, MemberKey], dict[int, MemberKey]]:
        """Owners by GPU UUID, and by index for the reservations that have no UUID ("")."""
        rows = await self._read("SELECT gpu_uuid, gpu_index, member_key FROM gpu_ownership")
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
            rows = await _fetchall(db, f"SELECT {MEMBER_COLUMNS} FROM members")
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
                await _insert_event(
                    db, at_ms, str(record.key), "gpu-uuids-filled", None, None, note,
                    {"gpu_indexes": list(record.gpu_indexes), "gpu_uuids": uuids},
                )  # fmt: skip
                changed.append(record.key)

        await self._write(fn)
        return changed

    # --- GPU health: XIDs and clears -----------------------------------------------------------

    async def xid_book(self) -> XidBook:
        """Every XID and GPU health event in the journal, as the book that judges them."""
        xids = await self._read(f"SELECT {XID_COLUMNS} FROM gpu_xids ORDER BY id")
        events = await self._read(f"SELECT {HEALTH_COLUMNS} FROM gpu_health_events ORDER BY id")
        return XidBook.of(map(xid_from_row, xids), map(health_from_row, events))

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
            await self._write(fn)
        return written

    async def record_health_events(self, rows: Sequence[NewHealthEvent]) -> None:
        """Journal GPU health events (clears, recovery-action changes) in one transaction."""

        async def fn(db: aiosqlite.Connection) -> None:
            for r in rows:
                await _insert_health(db, r)

        if rows:
            await self._write(fn)

    async def clear_gpu(self, uuid: str, at_ms: int, actor: str, reason: str) -> XidRecord | None:
        """Journal an operator clear of every XID of ``uuid`` so far; return the one it lifted.

        Read and written in one transaction, so an XID the daemon journals meanwhile is either
        covered (written before) or not (after), never half. When no XID disables ``uuid``
        nothing is written and None is returned.
        """
        lifted: list[XidRecord | None] = []

        async def fn(db: aiosqlite.Connection) -> None:
            xids = await _fetchall(db, f"SELECT {XID_COLUMNS} FROM gpu_xids ORDER BY id")
            events = await _fetchall(
                db, f"SELECT {HEALTH_COLUMNS} FROM gpu_health_events ORDER BY id"
            )
            book = XidBook.of(map(xid_from_row, xids), map(health_from_row, events))
            row, was = book.clear(uuid, at_ms, actor, reason)
            if was is not None:
                await _insert_health(db, row)
            lifted.append(was)

        await self._write(fn)
        return lifted[0]

    async def create_member(self, new: NewMember, at_ms: int) -> MemberRecord:
        """Journal a member in ``preparing``. Raises :class:`MemberExists` on a repeat."""

        async def fn(db: aiosqlite.Connection) -> None:
            try:
                await db.execute(
                    "INSERT INTO members (member_key, run_id, attempt, member_index, state, "
                    "created_at_ms, updated_at_ms, member_count, gpu_indexes, member_dir, "
                    "out_dir, grace_period_s, gpu_uuids) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
            await _insert_event(
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

        await self._write(fn)
        record = await self.member(new.key)
        assert record is not None
        return record

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

        async def fn(db: aiosqlite.Connection) -> None:
            rows = await _fetchall(
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
            await db.execute(
                f"UPDATE members SET {', '.join(sets)} WHERE member_key = ?", [*args, str(key)]
            )
            if extra is not None:
                await _insert_event(
                    db, at_ms, str(key), extra.kind, None, None, extra.reason, extra.details
                )
            event_details = dict(details or {})
            if exit is not None:
                event_details.update(exit_code=exit.exit_code, signal=exit.signal)
            if manifest:
                event_details["output_manifest"] = json.loads(manifest)
            await _insert_event(
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
                        owner = await _fetchall(
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
                seq_rows = await _fetchall(
                    db, "SELECT value FROM meta WHERE key = 'next_report_seq'"
                )
                seq = int(seq_rows[0][0])
                await db.execute(
                    "UPDATE meta SET value = ? WHERE key = 'next_report_seq'", (str(seq + 1),)
                )
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

        await self._write(fn)
        record = await self.member(key)
        assert record is not None
        # The report is built from what the transaction wrote, not read back: once committed,
        # the session may already have sent it, had it acknowledged and deleted the row.
        return record, (reports[0] if reports else None)

    # --- reports -----------------------------------------------------------------------------

    async def pending_reports(self) -> list[PendingReport]:
        """Every report the coordinator has not acknowledged, oldest first."""
        rows = await self._read(f"SELECT {REPORT_COLUMNS} FROM pending_reports ORDER BY report_seq")
        return [report_from_row(r, self.journal_id) for r in rows]

    async def counts(self) -> tuple[dict[str, int], int]:
        """Members by state, and how many reports wait for acknowledgement (two COUNTs)."""
        members = await self._read("SELECT state, COUNT(*) FROM members GROUP BY state")
        pending = await self._read("SELECT COUNT(*) FROM pending_reports")
        return {str(state): int(n) for state, n in members}, int(pending[0][0])

    async def ack_report(self, report_seq: int, refused: str = "", at_ms: int = 0) -> bool:
        """Drop an acknowledged report. A repeated or unknown acknowledgement is harmless.

        ``refused`` is the coordinator's sentence when it would not apply the report: the report
        is dropped all the same (resending cannot change the answer) and the refusal is kept as
        a ``report-refused`` event on the member, in the same transaction.
        """
        gone: list[int] = []

        async def fn(db: aiosqlite.Connection) -> None:
            rows = await _fetchall(
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
                await _insert_event(
                    db, at_ms, member_key, "report-refused", None, None, refused,
                    {"report_seq": report_seq, "state": state},
                )  # fmt: skip

        await self._write(fn)
        return bool(gone and gone[0])

    async def events(self, member: MemberKey | None = None) -> list[dict[str, Any]]:
        sql = (
            "SELECT id, at_ms, member_key, kind, from_state, to_state, reason, details FROM events"
        )
        args: tuple[Any, ...] = ()
        if member is not None:
            sql += " WHERE member_key = ?"
            args = (str(member),)
        rows = await self._read(sql + " ORDER BY id", args)
        names = ("id", "at_ms", "member_key", "kind", "from_state", "to_state", "reason")
        return [dict(zip(names, r[:7], strict=True), details=json.loads(r[7])) for r in rows]


async def _insert_event(
    db: aiosqlite.Connection,
    at_ms: int,
    member_key: str | None,
    kind: str,
    from_state: str | None,
    to_state: str | None,
    reason: str,
    details: Mapping[str, Any],
) -> None:
    await db.execute(
        "INSERT INTO events (at_ms, member_key, kind, from_state, to_state, reason, details) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)",
        (at_ms, member_key, kind, from_state, to_state, reason, json.dumps(dict(details))),
    )


def _gpus_of(record: MemberRecord) -> list[tuple[int, str]]:
    """(index, uuid) of each of a member's GPUs; uuid "" where the journal has none."""
    uuids = record.gpu_uuids or ("",) * len(record.gpu_indexes)
    return list(zip(record.gpu_indexes, uuids, strict=True))


async def _insert_health(db: aiosqlite.Connection, r: NewHealthEvent) -> None:
    await db.execute(
        "INSERT INTO gpu_health_events (gpu_uuid, at_ms, kind, actor, reason, through_xid_id, "
        "recovery_action) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (r.uuid, r.at_ms, r.kind, r.actor, r.reason, r.through_xid_id, r.recovery_action),
    )


async def _aio_transaction(
    db: aiosqlite.Connection,
    fn: Any,
    *args: Any,
    on_commit: Callable[[float], None] | None = None,
) -> Any:
    """Run ``fn(db, *args)`` inside BEGIN IMMEDIATE ... COMMIT; roll back on any error.

    ``on_commit`` is told how long the COMMIT took: with ``synchronous=FULL`` that is the fsync
    every journaled state change waits for.
    """
    await db.execute("BEGIN IMMEDIATE")
    try:
        result = await fn(db, *args)
    except BaseException:
        await db.execute("ROLLBACK")
        raise
    started = time.perf_counter()
    await db.execute("COMMIT")
    if on_commit is not None:
        on_commit(time.perf_counter() - started)
    return result


async def _aio_open(path: Path) -> aiosqlite.Connection:
    try:
        db = await aiosqlite.connect(str(path), isolation_level=None)
    except sqlite3.DatabaseError as exc:
        raise JournalCorrupt(f"The journal {path} cannot be opened: {exc}.") from None
    try:
        await db.execute("PRAGMA busy_timeout = 5000")
        check = await _fetchall(db, "PRAGMA integrity_check")
        if [tuple(r) for r in check] != [("ok",)]:
            problems = "; ".join(str(r[0]) for r in check[:3])
            raise JournalCorrupt(f"The journal {path} failed its integrity check: {problems}.")
        mode = await _fetchall(db, "PRAGMA journal_mode = WAL")
        if str(mode[0][0]).lower() != "wal":
            raise JournalError(f"The journal {path} could not switch to WAL mode ({mode[0][0]}).")
        await db.execute("PRAGMA synchronous = FULL")
        await db.execute("PRAGMA foreign_keys = ON")
        await _aio_migrate(db, path)
    except sqlite3.DatabaseError as exc:
        await db.close()
        raise JournalCorrupt(f"The journal {path} is not a sound SQLite database: {exc}.") from None
    except BaseException:
        await db.close()
        raise
    return db


async def _aio_migrate(db: aiosqlite.Connection, path: Path) -> None:
    version = int((await _fetchall(db, "PRAGMA user_version"))[0][0])
    if version > len(MIGRATIONS):
        raise JournalTooNew(
            f"The journal {path} has schema version {version}, but this agent knows only up to "
            f"{len(MIGRATIONS)}; run the newer tuneplane-node that wrote it."
        )
    for number in range(version + 1, len(MIGRATIONS) + 1):

        async def step(db: aiosqlite.Connection, number: int = number) -> None:
            for statement in MIGRATIONS[number - 1].split(";"):
                if statement.strip():
                    await db.execute(statement)
            await db.execute(
                "INSERT INTO meta (key, value) VALUES ('schema_version', ?) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (str(number),),
            )
            # PRAGMA user_version is transactional in SQLite, so it moves with the migration.
            await db.execute(f"PRAGMA user_version = {number}")

        await _aio_transaction(db, step)
        log.info("journal migrated path=%s schema_version=%d", path, number)
