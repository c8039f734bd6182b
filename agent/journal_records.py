"""What the journal holds, as values: member keys and records, pending reports, the event
kinds it writes, the errors it raises, and one converter per table from its rows.

Rules: rows are read by the column lists here (``MEMBER_COLUMNS`` ...) and turned into frozen
records by the converter beside them, and nowhere else; :mod:`tuneplane.agent.journal` and the
read-only :mod:`tuneplane.agent.journal_read` share them. Nothing here touches SQLite.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from .member_state import MemberEvent, MemberState
from .xid_book import HealthEvent, XidRecord

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
#: Member events of a runtime image made ready at Prepare (agent/members_prepare.py): the pull
#: started (details: image), moved on (bytes and layers done and total, phase), the image is
#: ready (bytes, layers, seconds), the pull failed (reason: the sentence) or was cancelled (an
#: Abort), and, after a restart, the pull finished again with no member waiting for it.
IMAGE_PULL_STARTED = "image-pull-started"
IMAGE_PULL_PROGRESS = "image-pull-progress"
IMAGE_READY = "image-ready"
IMAGE_PULL_FAILED = "image-pull-failed"
IMAGE_PULL_CANCELLED = "image-pull-cancelled"
IMAGE_EVENTS = frozenset(
    {IMAGE_PULL_STARTED, IMAGE_PULL_PROGRESS, IMAGE_READY, IMAGE_PULL_FAILED, IMAGE_PULL_CANCELLED}
)
#: Every event kind this agent writes (the lifecycle's, then the others), so a reader can tell a
#: kind that has not happened yet from a typo.
EVENT_KINDS: frozenset[str] = frozenset(e.value for e in MemberEvent) | {
    "prepare-received", "report-refused", "gpu-uuids-filled", MEMBER_REATTACHED, EXIT_COLLECTED,
    AGENT_STARTED, AGENT_STOPPED, AGENT_FAILED, "enrolled", "re-enrolled", "journal-created",
    CONTROL_ADDRESS_CHANGED, *IMAGE_EVENTS,
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
