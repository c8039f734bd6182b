"""The log shipper's chunk decision, and its offsets kept in a real journal across a reopen."""

from __future__ import annotations

import json
from pathlib import Path

from tuneplane.agent import messages as m
from tuneplane.agent.adapter import open_aio_host
from tuneplane.agent.journal import Journal
from tuneplane.agent.journal_records import MemberKey, NewMember
from tuneplane.agent.logship import (
    CHUNK_BYTES,
    KEEP_BYTES,
    LogShipper,
    NextChunk,
    meta_key,
    next_chunk,
)
from tuneplane.agent.member_state import MemberEvent

BIG = 10 * KEEP_BYTES


def test_nothing_to_send_while_running_and_caught_up() -> None:
    assert next_chunk(0, 0, terminal=False, budget=BIG) is None
    assert next_chunk(100, 100, terminal=False, budget=BIG) is None


def test_chunks_are_bounded_by_size_and_budget() -> None:
    assert next_chunk(10, 100, False, BIG) == NextChunk(10, 90, eof=False)
    assert next_chunk(0, 10 * CHUNK_BYTES, False, BIG) == NextChunk(0, CHUNK_BYTES, eof=False)
    assert next_chunk(0, 100, False, 40) == NextChunk(0, 40, eof=False)
    assert next_chunk(0, 100, False, 0) is None


def test_a_backlog_over_the_bound_skips_to_its_tail() -> None:
    size = 5 * KEEP_BYTES
    assert next_chunk(0, size, False, BIG) == NextChunk(size - KEEP_BYTES, CHUNK_BYTES, False)


def test_a_terminal_member_ends_its_stream() -> None:
    assert next_chunk(0, 0, terminal=True, budget=BIG) == NextChunk(0, 0, eof=True)
    assert next_chunk(50, 100, terminal=True, budget=BIG) == NextChunk(50, 50, eof=True)
    assert next_chunk(100, 100, terminal=True, budget=0) == NextChunk(100, 0, eof=True)
    # Not the whole rest yet: no eof on this chunk.
    assert next_chunk(0, 3 * CHUNK_BYTES, True, BIG) == NextChunk(0, CHUNK_BYTES, eof=False)


async def test_offsets_survive_a_reopen_and_shipping_resumes_there(tmp_path: Path) -> None:
    key = MemberKey("run-1", 1, 0)
    member_dir = tmp_path / "members" / str(key)
    member_dir.mkdir(parents=True)
    (member_dir / "stdout.log").write_bytes(b"line one\nline two\n")
    sent: list[m.Outgoing] = []

    async def send(message: m.Outgoing) -> None:
        sent.append(message)

    async with open_aio_host():
        journal = await Journal.open(tmp_path / "journal.db")
        await journal.create_member(
            NewMember(key, 1, (0,), str(member_dir), str(tmp_path / "out"), 5), 1
        )
        for event in (
            MemberEvent.PREPARE_SUCCEEDED,
            MemberEvent.COMMIT_RECEIVED,
            MemberEvent.SPAWN_REQUESTED,
            MemberEvent.RUNNER_STARTED,
        ):
            await journal.transition(key, event, 2)
        shipper = LogShipper(journal, send)
        await shipper.ship_once()
        chunks = [c for c in sent if isinstance(c, m.LogChunk)]
        assert [(c.stream, c.offset, c.data, c.eof) for c in chunks] == [
            ("stdout", 0, b"line one\nline two\n", False)
        ]
        # In flight: nothing more until it is acknowledged.
        await shipper.ship_once()
        assert len(sent) == 1
        await shipper.acked(m.LogAck(key, "stdout", 18, False))
        assert json.loads(await journal.get_meta(meta_key(key, "stdout")) or "{}") == {
            "offset": 18,
            "done": False,
        }
        await journal.close()

        # A restarted agent resumes from the journaled offset: only the new line goes.
        with (member_dir / "stdout.log").open("ab") as f:
            f.write(b"line three\n")
        journal = await Journal.open(tmp_path / "journal.db")
        sent.clear()
        await LogShipper(journal, send).ship_once()
        assert [(c.offset, c.data) for c in sent if isinstance(c, m.LogChunk)] == [
            (18, b"line three\n")
        ]
        await journal.close()
