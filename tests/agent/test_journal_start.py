"""The agent's start in its own journal: how the previous run ended (clean, unclean, first).

The judgement is pure (``judge_previous_stop``); ``record_start`` is tested on real SQLite
files, and the offline reader's new filters on a current journal and on an older one.
"""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
from pathlib import Path

import trio

from tests.support.agent import node_cli
from tuneplane.agent import journal_read
from tuneplane.agent.adapter import open_aio_host
from tuneplane.agent.daemon import _orderly
from tuneplane.agent.journal import Journal
from tuneplane.agent.journal_records import AGENT_STARTED, AGENT_STOPPED, judge_previous_stop

FIXTURE_V2 = Path(__file__).parent / "fixtures" / "journal-v2.db"


def test_no_earlier_start_is_a_first_start() -> None:
    found = judge_previous_stop(None, None, 1_000)
    assert found.how == "first" and found.stopped_at_ms is None
    assert found.sentence() == "first start with this journal"


def test_a_stop_marker_last_means_a_clean_stop() -> None:
    found = judge_previous_stop(AGENT_STOPPED, 5_000, 5_000)
    assert found.how == "clean" and found.stopped_at_ms == 5_000
    assert found.sentence() == "the previous run stopped cleanly at 1970-01-01T00:00:05Z"


def test_a_start_with_no_stop_after_it_means_an_unclean_stop() -> None:
    found = judge_previous_stop(AGENT_STARTED, 1_000, 7_000)
    assert found.how == "unclean" and found.last_event_at_ms == 7_000
    assert "did not stop cleanly" in found.sentence()
    assert "1970-01-01T00:00:07Z" in found.sentence()


async def test_record_start_judges_each_start_from_the_journal(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    async with open_aio_host():
        journal = await Journal.open(path)
        try:
            first = await journal.record_start(1_000, version="v", pid=11, state_dir="/s")
            await journal.node_event(2_000, AGENT_STOPPED, "orderly stop")
            clean = await journal.record_start(3_000, version="v", pid=12, state_dir="/s")
            await journal.node_event(4_000, "enrolled")
            # No stop marker: the run that started at 3_000 was killed.
            unclean = await journal.record_start(9_000, version="v", pid=13, state_dir="/s")
        finally:
            await journal.close()
    assert (first.how, clean.how, unclean.how) == ("first", "clean", "unclean")
    assert clean.stopped_at_ms == 2_000 and unclean.last_event_at_ms == 4_000
    with journal_read.open_readonly(path) as db:
        starts = journal_read.events(db, kinds=[AGENT_STARTED])
        node = journal_read.events(db, node_only=True)
    assert [e["details"]["previous_stop"] for e in starts] == ["first", "clean", "unclean"]
    assert starts[-1]["details"] == {
        "version": "v", "pid": 13, "state_dir": "/s", "previous_stop": "unclean",
        "last_event_at_ms": 4_000, "stopped_at_ms": None,
    }  # fmt: skip
    assert starts[-1]["member"] is None
    assert [e["kind"] for e in node] == [
        AGENT_STARTED, AGENT_STOPPED, AGENT_STARTED, "enrolled", AGENT_STARTED
    ]  # fmt: skip


def _cli(state_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        node_cli("journal", *args, "--state-dir", str(state_dir)),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_pending_and_filtered_events_read_an_older_journal_without_changing_it(
    tmp_path: Path,
) -> None:
    shutil.copy(FIXTURE_V2, tmp_path / "journal.db")
    before = (tmp_path / "journal.db").read_bytes()
    with sqlite3.connect(tmp_path / "journal.db") as db:
        expected = [r[0] for r in db.execute("SELECT report_seq FROM pending_reports")]
    assert expected, "the fixture holds unacknowledged reports"

    pending = _cli(tmp_path, "pending")
    assert pending.returncode == 0, pending.stderr
    assert pending.stdout.splitlines()[0].split() == [
        "REPORT_SEQ", "AT", "MEMBER", "STATE", "EXIT", "REASON"
    ]  # fmt: skip
    assert len(pending.stdout.splitlines()) == 1 + len(expected)
    node = _cli(tmp_path, "events", "--node")
    assert node.returncode == 0 and node.stdout.strip() == "(none)", node.stderr
    exits = _cli(tmp_path, "events", "--kind", "exit-observed", "--json")
    assert exits.returncode == 0, exits.stderr
    assert "exit-observed" in exits.stdout and "runner-started" not in exits.stdout
    assert (tmp_path / "journal.db").read_bytes() == before


def test_a_mistyped_kind_is_refused_with_the_kinds_and_a_known_one_is_an_empty_answer(
    tmp_path: Path,
) -> None:
    shutil.copy(FIXTURE_V2, tmp_path / "journal.db")
    done = _cli(tmp_path, "events", "--kind", "agent-crashd")
    assert done.returncode == 1
    assert "--kind agent-crashd is not an event kind" in done.stderr
    assert "agent-started" in done.stderr and "exit-observed" in done.stderr
    # A kind the agent writes that this (older) journal never held is an empty answer.
    none_yet = _cli(tmp_path, "events", "--kind", "exit-collected")
    assert none_yet.returncode == 0 and none_yet.stdout.strip() == "(none)", none_yet.stderr
    both = _cli(tmp_path, "events", "--node", "--member", "run-old.1.0")
    assert both.returncode == 1 and "contradict" in both.stderr


async def test_only_a_cancellation_reads_as_an_orderly_stop() -> None:
    cancelled: list[BaseException] = []
    with trio.CancelScope() as scope:
        scope.cancel()
        try:
            await trio.lowlevel.checkpoint()
        except trio.Cancelled as exc:
            cancelled.append(exc)
            raise
    (stop,) = cancelled
    assert _orderly(None) and _orderly(stop) and _orderly(KeyboardInterrupt())
    assert _orderly(BaseExceptionGroup("nursery", [stop, stop]))
    assert not _orderly(ValueError("journal full"))
    assert not _orderly(BaseExceptionGroup("nursery", [stop, OSError("disk")]))
