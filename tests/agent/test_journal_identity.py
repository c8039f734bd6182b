"""The journal's identity (``meta.journal_id``) and refused reports: in the journal, the offline
reader, the wire and the session core, on real SQLite files."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from tuneplane.agent import journal_read, wire_convert
from tuneplane.agent import messages as m
from tuneplane.agent.adapter import open_aio_host
from tuneplane.agent.inventory import SimulatedGpus, simulated_inventory
from tuneplane.agent.journal import Journal
from tuneplane.agent.journal_records import MemberKey, NewMember, PendingReport
from tuneplane.agent.journal_schema import MIGRATIONS, SCHEMA_VERSION
from tuneplane.agent.member_state import MemberEvent, MemberState
from tuneplane.agent.session import ControlSession, DropReport
from tuneplane.proto import v1

E = MemberEvent
KEY = MemberKey("r-1", 1, 0)


def _member() -> NewMember:
    return NewMember(KEY, 1, (0,), "/m/r-1", "/o/r-1/attempt-1/member-0", 5)


def _version_1_journal(path: Path) -> None:
    """A journal as the agent before journal ids wrote it, with one report not yet acked."""
    with sqlite3.connect(path) as db:
        db.executescript(MIGRATIONS[0])
        db.execute("INSERT INTO meta (key, value) VALUES ('schema_version', '1')")
        db.execute(
            "INSERT INTO members (member_key, run_id, attempt, member_index, state, created_at_ms,"
            " updated_at_ms, member_count, gpu_indexes, member_dir, out_dir, grace_period_s) "
            "VALUES ('r-1.1.0', 'r-1', 1, 0, 'committed', 1, 1, 1, '[0]', '/m', '/o', 5)"
        )
        db.execute(
            "INSERT INTO pending_reports (report_seq, member_key, state, at_ms) "
            "VALUES (41, 'r-1.1.0', 'committed', 1)"
        )
        db.execute("PRAGMA user_version = 1")


async def test_every_new_journal_gets_its_own_random_id_and_keeps_it(tmp_path: Path) -> None:
    async with open_aio_host():
        first = await Journal.open(tmp_path / "a.db")
        second = await Journal.open(tmp_path / "b.db")
        ids = {first.journal_id, second.journal_id}
        assert len(ids) == 2 and all(len(i) == 32 for i in ids), ids
        await first.close()
        await second.close()
        again = await Journal.open(tmp_path / "a.db")
        assert again.journal_id == first.journal_id
        await again.create_member(_member(), 1)
        await again.transition(KEY, E.PREPARE_SUCCEEDED, 2)
        _, report = await again.transition(KEY, E.COMMIT_RECEIVED, 3)
        assert report is not None and report.journal_id == first.journal_id
        assert [r.journal_id for r in await again.pending_reports()] == [first.journal_id]
        await again.close()


async def test_an_existing_journal_gets_an_id_when_this_agent_first_opens_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "journal.db"
    _version_1_journal(path)
    async with open_aio_host():
        journal = await Journal.open(path)
        assert journal.journal_id and len(journal.journal_id) == 32
        (pending,) = await journal.pending_reports()
        assert (pending.report_seq, pending.journal_id) == (41, journal.journal_id)
        await journal.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        (stored,) = db.execute("SELECT value FROM meta WHERE key = 'journal_id'").fetchone()
    assert stored == journal.journal_id


async def test_a_refused_report_is_dropped_and_the_refusal_journaled(tmp_path: Path) -> None:
    async with open_aio_host():
        journal = await Journal.open(tmp_path / "journal.db")
        await journal.create_member(_member(), 1)
        await journal.transition(KEY, E.PREPARE_SUCCEEDED, 2)
        _, report = await journal.transition(KEY, E.COMMIT_RECEIVED, 3)
        assert report is not None
        why = "Node node-a reported r-1 attempt 1 member 0 as 'committed', but ... changed nothing."
        assert await journal.ack_report(report.report_seq, why, 4)
        assert await journal.pending_reports() == []
        refused = [e for e in await journal.events(KEY) if e["kind"] == "report-refused"]
        assert refused == [
            {
                "id": refused[0]["id"],
                "at_ms": 4,
                "member_key": str(KEY),
                "kind": "report-refused",
                "from_state": None,
                "to_state": None,
                "reason": why,
                "details": {"report_seq": report.report_seq, "state": "committed"},
            }
        ]
        # A repeated acknowledgement changes nothing and journals nothing more.
        assert not await journal.ack_report(report.report_seq, why, 5)
        assert len([e for e in await journal.events(KEY) if e["kind"] == "report-refused"]) == 1
        await journal.close()


async def test_the_offline_reader_shows_which_journal_numbered_each_report(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    async with open_aio_host():
        journal = await Journal.open(path)
        await journal.create_member(_member(), 1)
        await journal.transition(KEY, E.PREPARE_SUCCEEDED, 2)
        await journal.transition(KEY, E.COMMIT_RECEIVED, 3)
        await journal.close()
    with journal_read.open_readonly(path) as db:
        (report,) = journal_read.pending_reports(db)
        exported = journal_read.export(db)
    assert report.journal_id == journal.journal_id
    assert exported["meta"]["journal_id"] == journal.journal_id
    assert [r["journal_id"] for r in exported["pending_reports"]] == [journal.journal_id]


def test_the_wire_carries_the_journal_id_out_and_a_refusal_in_to_the_journal() -> None:
    pending = PendingReport(5, KEY, MemberState.RUNNING, 1, "", None, "/o", journal_id="ab" * 16)
    sent = wire_convert.to_wire(m.Report(pending))
    assert (sent.report.report_seq, sent.report.journal_id) == (5, "ab" * 16)
    why = "Node node-a reported r-1 attempt 1 member 0 as 'running', but … changed nothing."
    ack = wire_convert.from_wire(
        v1.CoordinatorMessage(report_ack=v1.ReportAck(report_seq=5, refused=why))
    )
    assert ack == m.ReportAck(5, why)
    session = ControlSession("node-a", "test")
    session.start(0.0, simulated_inventory("node-a", SimulatedGpus("h200", 1)), [])
    session.receive(0.0, m.Welcome(500, 3000, 0))
    assert session.receive(0.1, ack) == [DropReport(5, why)]
    # An ordinary acknowledgement carries no refusal.
    assert session.receive(0.2, m.ReportAck(6)) == [DropReport(6, "")]
