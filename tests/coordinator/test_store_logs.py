"""The coordinator's log store (SQLite and PostgreSQL): idempotent by offset, bounded, in order."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from tests.support.store_backend import current
from tuneplane.coordinator.store.logs import KEEP_BYTES, BadStream, LogStore
from tuneplane.coordinator.values.jobs import MemberKey
from tuneplane.coordinator.values.lifecycle import LogPiece

M = MemberKey("run-1", 1, 0)


def _run(tmp_path: Path, work: Callable[[LogStore], Awaitable[None]]) -> None:
    async def go() -> None:
        store = await LogStore.open(current().where(tmp_path / "logs.db"))
        try:
            await work(store)
        finally:
            await store.close()

    asyncio.run(go())


def test_a_resent_chunk_is_stored_once(tmp_path: Path) -> None:
    async def work(store: LogStore) -> None:
        assert (await store.append(M, "stdout", 0, b"hello\n", False, 1)).offset == 6
        # The same chunk again (its ack was lost), then one overlapping what is stored.
        assert (await store.append(M, "stdout", 0, b"hello\n", False, 2)).offset == 6
        assert (await store.append(M, "stdout", 3, b"lo\nworld\n", False, 3)).offset == 12
        read = await store.read(M, "stdout", 0, KEEP_BYTES)
        assert b"".join(p.data for p in read.pieces) == b"hello\nworld\n"
        assert (read.next_offset, read.complete, read.dropped_bytes) == (12, False, 0)

    _run(tmp_path, work)


def test_the_end_is_recorded_only_at_the_end(tmp_path: Path) -> None:
    async def work(store: LogStore) -> None:
        await store.append(M, "stderr", 0, b"abc", False, 1)
        await store.append(M, "stderr", 3, b"def", False, 2)
        # An old copy of the first chunk, marked eof by mistake, must not end the stream early.
        assert not (await store.append(M, "stderr", 0, b"abc", True, 3)).complete
        done = await store.append(M, "stderr", 6, b"", True, 4)
        assert (done.offset, done.complete) == (6, True)
        assert (await store.read(M, "stderr", 0, KEEP_BYTES)).complete
        assert not (await store.read(M, "stderr", 0, 2)).complete
        # After the end nothing more is stored.
        assert (await store.append(M, "stderr", 6, b"late", False, 5)).offset == 6

    _run(tmp_path, work)


def test_at_most_the_bound_is_kept_and_the_reader_sees_what_was_dropped(tmp_path: Path) -> None:
    chunk = 64 * 1024

    async def work(store: LogStore) -> None:
        for i in range(20):
            await store.append(M, "stdout", i * chunk, bytes([65 + i]) * chunk, False, i)
        read = await store.read(M, "stdout", 0, 2 * KEEP_BYTES)
        kept = sum(len(p.data) for p in read.pieces)
        assert kept <= KEEP_BYTES
        assert read.dropped_bytes == 20 * chunk - kept
        assert read.pieces[0].dropped_before == read.dropped_bytes
        assert read.pieces[-1].data.endswith(bytes([65 + 19]) * 10)
        assert read.next_offset == 20 * chunk
        # A Node that skipped ahead (its backlog was over the bound): the gap counts as dropped.
        await store.append(M, "stdout", 30 * chunk, b"tail", False, 30)
        later = await store.read(M, "stdout", 20 * chunk, KEEP_BYTES)
        assert later.pieces == (LogPiece(30 * chunk, b"tail", 10 * chunk),)

    _run(tmp_path, work)


def test_reads_page_by_max_bytes_and_survive_a_reopen(tmp_path: Path) -> None:
    async def first(store: LogStore) -> None:
        await store.append(M, "stdout", 0, b"0123456789", False, 1)

    async def second(store: LogStore) -> None:
        page = await store.read(M, "stdout", 0, 4)
        assert [p.data for p in page.pieces] == [b"0123"] and page.next_offset == 4
        page = await store.read(M, "stdout", page.next_offset, 100)
        assert [p.data for p in page.pieces] == [b"456789"] and page.next_offset == 10
        empty = await store.read(MemberKey("run-2", 1, 0), "stdout", 0, 100)
        assert (empty.pieces, empty.next_offset, empty.complete) == ((), 0, False)
        with pytest.raises(BadStream, match="stdin"):
            await store.read(M, "stdin", 0, 10)

    _run(tmp_path, first)
    _run(tmp_path, second)


def test_an_empty_chunk_past_the_end_counts_as_dropped_and_later_bytes_still_land(
    tmp_path: Path,
) -> None:
    async def work(store: LogStore) -> None:
        await store.append(M, "stdout", 0, b"ab", False, 1)
        assert (await store.append(M, "stdout", 5, b"", False, 2)).offset == 5
        tail = await store.read(M, "stdout", 0, 100)
        assert tail.pieces == (LogPiece(0, b"ab", 0), LogPiece(5, b"", 3))
        assert tail.next_offset == 5
        assert (await store.append(M, "stdout", 5, b"cd", True, 3)).complete
        done = await store.read(M, "stdout", 5, 100)
        assert (done.pieces, done.next_offset, done.complete) == ((LogPiece(5, b"cd", 0),), 7, True)

    _run(tmp_path, work)


def test_the_tail_is_the_last_bytes_after_any_gap(tmp_path: Path) -> None:
    async def work(store: LogStore) -> None:
        assert await store.tail(M, "stderr", 10) == (b"", 0)
        await store.append(M, "stderr", 0, b"first\n", False, 1)
        await store.append(M, "stderr", 6, b"second\n", False, 2)
        assert await store.tail(M, "stderr", 100) == (b"first\nsecond\n", 0)
        assert await store.tail(M, "stderr", 9) == (b"t\nsecond\n", 4)
        # The Node dropped bytes 13..20 of its backlog: only what follows the gap is a tail.
        await store.append(M, "stderr", 20, b"third\n", False, 3)
        assert await store.tail(M, "stderr", 100) == (b"third\n", 20)

    _run(tmp_path, work)
