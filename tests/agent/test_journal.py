"""The member journal on real SQLite files."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from tuneplane.agent.adapter import open_aio_host
from tuneplane.agent.journal import Journal
from tuneplane.agent.journal_records import (
    Exit,
    GpuAlreadyOwned,
    JournalCorrupt,
    JournalTooNew,
    MemberExists,
    MemberKey,
    NewMember,
)
from tuneplane.agent.journal_schema import SCHEMA_VERSION
from tuneplane.agent.member_state import IllegalTransition, MemberEvent, MemberState

E = MemberEvent


def new_member(run: str, gpus: tuple[int, ...], index: int = 0) -> NewMember:
    return NewMember(
        key=MemberKey(run, 1, index),
        member_count=1,
        gpu_indexes=gpus,
        member_dir=f"/m/{run}",
        out_dir=f"/o/{run}",
        grace_period_s=5,
    )


async def test_fresh_journal_is_migrated_wal_and_full_sync(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    async with open_aio_host():
        journal = await Journal.open(path)
        assert await journal.get_meta("schema_version") == str(SCHEMA_VERSION)
        await journal.close()
        # Reopening does not run the migration again (it would fail on CREATE TABLE).
        journal = await Journal.open(path)
        await journal.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


async def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA user_version = 99")
    async with open_aio_host():
        with pytest.raises(JournalTooNew, match="schema version 99"):
            await Journal.open(path)


async def test_lifecycle_owns_and_releases_gpus_and_queues_reports(tmp_path: Path) -> None:
    async with open_aio_host():
        journal = await Journal.open(tmp_path / "journal.db")
        key = MemberKey("run-a", 1, 0)
        await journal.create_member(new_member("run-a", (0, 1)), at_ms=1)
        record, report = await journal.transition(key, E.PREPARE_SUCCEEDED, 2)
        assert record.state is MemberState.PREPARED and report is None
        assert await journal.gpu_owners() == {0: key, 1: key}
        record, report = await journal.transition(key, E.COMMIT_RECEIVED, 3, rendezvous=("h", 7))
        assert (record.master_addr, record.master_port) == ("h", 7)
        assert report is not None and report.state is MemberState.COMMITTED
        await journal.transition(key, E.SPAWN_REQUESTED, 4)
        await journal.transition(key, E.RUNNER_STARTED, 5)
        record, report = await journal.transition(
            key, E.EXIT_OBSERVED, 6, exit=Exit(exit_code=3, signal=None)
        )
        assert record.exit == Exit(3, None)
        assert report is not None and report.exit == Exit(3, None)
        assert await journal.gpu_owners() == {}
        seqs = [r.report_seq for r in await journal.pending_reports()]
        assert seqs == sorted(seqs) and len(seqs) == 4
        kinds = [e["kind"] for e in await journal.events(key)]
        assert kinds == [
            "prepare-received", "prepare-succeeded", "commit-received", "spawn-requested",
            "runner-started", "exit-observed",
        ]  # fmt: skip
        await journal.close()


async def test_a_gpu_can_never_be_owned_twice(tmp_path: Path) -> None:
    async with open_aio_host():
        journal = await Journal.open(tmp_path / "journal.db")
        await journal.create_member(new_member("run-a", (0, 1)), 1)
        await journal.transition(MemberKey("run-a", 1, 0), E.PREPARE_SUCCEEDED, 2)
        await journal.create_member(new_member("run-b", (1, 2)), 3)
        with pytest.raises(GpuAlreadyOwned, match=r"GPU 1 is already owned by member run-a\.1\.0"):
            await journal.transition(MemberKey("run-b", 1, 0), E.PREPARE_SUCCEEDED, 4)
        # Nothing of the refused transition was written: still preparing, GPU 2 still free.
        record = await journal.member(MemberKey("run-b", 1, 0))
        assert record is not None and record.state is MemberState.PREPARING
        assert set(await journal.gpu_owners()) == {0, 1}
        with pytest.raises(MemberExists):
            await journal.create_member(new_member("run-a", (5,)), 5)
        await journal.close()


async def test_an_illegal_move_writes_nothing(tmp_path: Path) -> None:
    async with open_aio_host():
        journal = await Journal.open(tmp_path / "journal.db")
        key = MemberKey("run-a", 1, 0)
        await journal.create_member(new_member("run-a", (0,)), 1)
        before = await journal.events()
        with pytest.raises(IllegalTransition):
            await journal.transition(key, E.SPAWN_REQUESTED, 2)
        assert await journal.events() == before
        await journal.close()


async def test_report_seq_survives_reopen_and_acks(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    async with open_aio_host():
        journal = await Journal.open(path)
        key = MemberKey("run-a", 1, 0)
        await journal.create_member(new_member("run-a", (0,)), 1)
        await journal.transition(key, E.ABORT_RECEIVED, 2, reason="coordinator aborted")
        (first,) = await journal.pending_reports()
        assert await journal.ack_report(first.report_seq)
        assert not await journal.ack_report(first.report_seq)  # a repeated ack is harmless
        await journal.close()

        journal = await Journal.open(path)
        await journal.create_member(new_member("run-b", (0,)), 3)
        await journal.transition(MemberKey("run-b", 1, 0), E.PREPARE_FAILED, 4, reason="x")
        (second,) = await journal.pending_reports()
        assert second.report_seq > first.report_seq
        await journal.close()


async def test_key_round_trips_with_dots_in_the_run_id() -> None:
    key = MemberKey("run.with.dots", 3, 7)
    assert MemberKey.parse(str(key)) == key
    with pytest.raises(ValueError, match=r"<run id>\.<attempt>\.<member index>"):
        MemberKey.parse("nonsense")


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
async def test_a_damaged_journal_is_reported_corrupt(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "journal.db"
    async with open_aio_host():
        journal = await Journal.open(path)
        for i in range(40):
            await journal.create_member(new_member(f"run-{i}", ()), i)
        await journal.close()
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:
        path.write_bytes(data[:4096] + b"\xde\xad" * 2048 + data[8192:])
    async with open_aio_host():
        with pytest.raises(JournalCorrupt, match=str(path)):
            await Journal.open(path)
