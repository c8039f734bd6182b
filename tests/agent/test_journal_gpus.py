"""Journal migration 3 on a real v2 file, GPU ownership by UUID, XIDs and clears on disk."""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from tuneplane.agent.adapter import open_aio_host
from tuneplane.agent.inventory import Gpu, Inventory
from tuneplane.agent.journal import Journal
from tuneplane.agent.journal_records import GpuAlreadyOwned, MemberKey, NewMember
from tuneplane.agent.journal_schema import SCHEMA_VERSION
from tuneplane.agent.member_state import MemberEvent, MemberState
from tuneplane.agent.xid_book import judge

E = MemberEvent
OLD = MemberKey("run-old", 1, 0)
DONE = MemberKey("run-done", 1, 0)


def inventory(*uuids: str) -> Inventory:
    gpus = tuple(Gpu(i, u, "NVIDIA H200", "h200", 2**30, False, True) for i, u in enumerate(uuids))
    return Inventory("node", 4, 2**34, gpus, "scripted-nvml")


# A journal written by the version-2 agent itself (agent/journal.py at 4b0220a): member
# run-old.1.0 running on GPUs 0 and 2, run-done.1.0 exited after running on GPU 1.
V2_FIXTURE = Path(__file__).parent / "fixtures" / "journal-v2.db"


def write_v2_journal(path: Path) -> None:
    """A copy of the version-2 fixture at ``path`` (the fixture itself is never opened)."""
    shutil.copyfile(V2_FIXTURE, path)
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 2


async def test_a_v2_journal_migrates_and_its_members_get_uuids(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    write_v2_journal(path)
    async with open_aio_host():
        journal = await Journal.open(path)
        try:
            # Straight after the migration: the reservations are kept, by index, uuid "".
            assert await journal.gpu_owners() == {0: OLD, 2: OLD}
            assert await journal.gpu_owners_by_uuid() == ({}, {0: OLD, 2: OLD})
            record = await journal.member(OLD)
            assert record is not None and record.gpu_uuids == ()
            # The daemon fills them from its first inventory; GPU 2 has gone: kept by index.
            filled = await journal.fill_member_uuids(inventory("GPU-a", "GPU-b"), 10)
            assert filled == [OLD]  # the ended member is left as it was
            record = await journal.member(OLD)
            assert record is not None and record.gpu_uuids == ("GPU-a", "")
            assert await journal.gpu_owners_by_uuid() == ({"GPU-a": OLD}, {2: OLD})
            (note,) = [e for e in await journal.events(OLD) if e["kind"] == "gpu-uuids-filled"]
            assert "GPU 2 not in the inventory" in note["reason"]
            # Filling again changes nothing more.
            assert await journal.fill_member_uuids(inventory("GPU-a", "GPU-b"), 11) == []
            # The card GPU-a cannot be given to another member, whatever its index now.
            new = MemberKey("run-new", 1, 0)
            await journal.create_member(
                NewMember(new, 1, (3,), "/m/n", "/o/n", 5, gpu_uuids=("GPU-a",)), 12
            )
            with pytest.raises(GpuAlreadyOwned, match=r"GPU 3 \(GPU-a\) is already owned by"):
                await journal.transition(new, E.PREPARE_SUCCEEDED, 13)
            record = await journal.member(new)
            assert record is not None and record.state is MemberState.PREPARING
            # The unnamed reservation of index 2 still blocks index 2.
            other = MemberKey("run-other", 1, 0)
            await journal.create_member(NewMember(other, 1, (2,), "/m/o", "/o/o", 5), 14)
            with pytest.raises(GpuAlreadyOwned, match="GPU 2 is already owned by"):
                await journal.transition(other, E.PREPARE_SUCCEEDED, 15)
        finally:
            await journal.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        rows = db.execute(
            "SELECT gpu_uuid, gpu_index, member_key FROM gpu_ownership ORDER BY gpu_index"
        ).fetchall()
        assert rows == [("GPU-a", 0, str(OLD)), ("", 2, str(OLD))]


async def test_xids_and_clears_survive_reopening_and_read_with_plain_sqlite(
    tmp_path: Path,
) -> None:
    path = tmp_path / "journal.db"
    async with open_aio_host():
        journal = await Journal.open(path)
        written = await journal.record_xids(
            [judge("GPU-a", 79, 1000), judge("GPU-a", 13, 1001), judge("", 48, 1002)]
        )
        assert [(x.id, x.application) for x in written] == [(1, False), (2, True), (3, False)]
        await journal.close()
        journal = await Journal.open(path)
        try:
            book = await journal.xid_book()
            assert [x.xid for x in book.xids] == [79, 13, 48]
            assert book.disabling("GPU-a") is not None and book.application_count("GPU-a") == 1
            lifted = await journal.clear_gpu("GPU-a", 2000, "operator root", "reset")
            assert lifted is not None and lifted.xid == 48
            # Nothing left to clear: nothing is written.
            assert await journal.clear_gpu("GPU-a", 2001, "operator root", "again") is None
            assert await journal.clear_gpu("GPU-zz", 2002, "operator root", "typo") is not None
            book = await journal.xid_book()
            assert book.disabling("GPU-a") is None
        finally:
            await journal.close()
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        xids = db.execute("SELECT gpu_uuid, xid, application FROM gpu_xids ORDER BY id")
        assert xids.fetchall() == [("GPU-a", 79, 0), ("GPU-a", 13, 1), ("", 48, 0)]
        assert db.execute(
            "SELECT gpu_uuid, kind, actor, reason, through_xid_id FROM gpu_health_events"
        ).fetchall() == [
            ("GPU-a", "operator-clear", "operator root", "reset", 3),
            ("GPU-zz", "operator-clear", "operator root", "typo", 3),
        ]


def node_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tuneplane.agent.cli", *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


async def test_gpu_clear_and_journal_gpus_through_the_cli(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    path = state / "journal.db"
    async with open_aio_host():
        journal = await Journal.open(path)
        await journal.record_xids([judge("GPU-a", 79, 1_767_225_600_000)])
        await journal.close()
    listed = node_cli("journal", "gpus", "--state-dir", str(state))
    assert listed.returncode == 0, listed.stderr
    assert re.search(
        r"GPU-a +XID 79 at 2026-01-01T00:00:00Z: GPU has fallen off the bus", listed.stdout
    )
    doctor = node_cli("doctor", "--state-dir", str(state)).stdout
    assert (
        "warn  GPU GPU-a is disabled by XID 79 at 2026-01-01T00:00:00Z: GPU has fallen off the "
        "bus; after a reset or a check run `tuneplane-node gpu clear GPU-a --reason ...`"
    ) in doctor, doctor
    before = path.read_bytes()
    for args, why in (
        (["GPU-a", "--reason", " "], "--reason must say"),
        (["GPU-b", "--reason", "reset"], "No XID disables GPU GPU-b"),
        ([" ", "--reason", "reset"], "The GPU UUID is empty"),
    ):
        refused = node_cli("gpu", "clear", *args, "--state-dir", str(state))
        assert refused.returncode == 1 and why in refused.stderr, refused.stderr
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT count(*) FROM gpu_health_events").fetchone()[0] == 0
    assert path.read_bytes() == before
    missing = node_cli("gpu", "clear", "GPU-a", "--reason", "x", "--state-dir", str(tmp_path))
    assert missing.returncode == 1 and "There is no journal at" in missing.stderr
    assert not (tmp_path / "journal.db").exists()
    cleared = node_cli("gpu", "clear", "GPU-a", "--reason", "reset, checks pass", "--state-dir",
                       str(state))  # fmt: skip
    assert cleared.returncode == 0, cleared.stderr
    assert "cleared GPU-a: XID 79 no longer disables it" in cleared.stdout
    doctor = node_cli("doctor", "--state-dir", str(state)).stdout
    assert "warn  GPU" not in doctor, doctor
    assert "XID history: 1 XIDs journaled (0 application, counted only), 1 clears" in doctor
    shown = json.loads(node_cli("journal", "gpus", "--json", "--state-dir", str(state)).stdout)
    assert shown["disabled"] == []
    assert [h["what"] for h in shown["history"]] == ["xid 79", "operator-clear"]
    assert shown["history"][1]["detail"].endswith(": reset, checks pass")


async def test_an_open_journal_sees_its_own_xids_and_a_clear_another_process_commits(
    tmp_path: Path,
) -> None:
    """The book is kept between reads (every inventory refresh asks), yet never stale: the
    journal's own writes and the operator's ``gpu clear`` (another process, with the daemon's
    journal open) both show at the next read."""
    state = tmp_path / "state"
    state.mkdir()
    async with open_aio_host():
        journal = await Journal.open(state / "journal.db")
        try:
            assert (await journal.xid_book()).xids == ()
            await journal.record_xids([judge("GPU-a", 79, 1000)])
            book = await journal.xid_book()
            assert book.disabling("GPU-a") is not None
            # Nothing changed: the same book, not read again.
            assert await journal.xid_book() is book
            cleared = await trio.run_process(
                [sys.executable, "-m", "tuneplane.agent.cli", "gpu", "clear", "GPU-a",
                 "--reason", "reset", "--state-dir", str(state)],
                capture_stdout=True, capture_stderr=True, check=False,
            )  # fmt: skip
            assert cleared.returncode == 0, cleared.stderr
            after = await journal.xid_book()
            assert after.disabling("GPU-a") is None
            assert [e.kind for e in after.events] == ["operator-clear"]
            await journal.record_health_events(
                after.observe(inventory_with_action("GPU-a", "gpu_reset"), 3000)
            )
            assert [e.kind for e in (await journal.xid_book()).events][-1] == "recovery-action"
        finally:
            await journal.close()


def inventory_with_action(uuid: str, action: str) -> Inventory:
    gpu = Gpu(0, uuid, "NVIDIA H200", "h200", 2**30, False, True, recovery_action=action)
    return Inventory("node", 4, 2**34, (gpu,), "scripted-nvml")


def test_the_cli_reads_a_v2_journal_an_older_agent_still_runs_on_without_changing_it(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    path = state / "journal.db"
    write_v2_journal(path)
    before = path.read_bytes()
    members = node_cli("journal", "members", "--json", "--state-dir", str(state))
    assert members.returncode == 0, members.stderr
    assert {m["member"]: m["gpu_uuids"] for m in json.loads(members.stdout)} == {
        str(OLD): [], str(DONE): [],
    }  # fmt: skip
    owned = node_cli("journal", "reservations", "--json", "--state-dir", str(state))
    assert owned.returncode == 0, owned.stderr
    assert [(g["gpu_index"], g["gpu_uuid"]) for g in json.loads(owned.stdout)["gpus"]] == [
        (0, ""), (2, ""),
    ]  # fmt: skip
    gpus = node_cli("journal", "gpus", "--json", "--state-dir", str(state))
    assert json.loads(gpus.stdout) == {"disabled": [], "history": []}
    assert path.read_bytes() == before
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 2
