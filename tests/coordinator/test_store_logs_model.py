"""The log store against a plain model: any mix of resent, overlapping and skipping chunks.

Hypothesis drives a real SQLite LogStore with chunks cut from one growing file, the way a Node
resends after a lost ack or skips a backlog; what it returns must be the model's bytes exactly.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.store_backend import current
from tuneplane.coordinator.store.logs import KEEP_BYTES, LogStore
from tuneplane.coordinator.values.jobs import MemberKey

M = MemberKey("run-m", 1, 0)
FILE = bytes(i % 251 for i in range(3 * KEEP_BYTES))

# (start, length) of chunks a Node might send: anywhere in the file, up to 256 KiB long.
chunks = st.lists(
    st.tuples(st.integers(0, len(FILE) - 1), st.integers(0, 256 * 1024)), min_size=1, max_size=12
)


@settings(max_examples=40, deadline=None)
@given(sends=chunks)
def test_stored_bytes_are_the_file_bytes_and_bounded(sends: list[tuple[int, int]]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        asyncio.run(_check(Path(folder), sends))


async def _check(folder: Path, sends: list[tuple[int, int]]) -> None:
    store = await LogStore.open(current().where(folder / "logs.db", fresh=True))
    try:
        held = 0  # the model: everything before `held` is stored or dropped
        for start, length in sends:
            data = FILE[start : start + length]
            ack = await store.append(M, "stdout", start, data, False, 1)
            held = max(held, start + len(data))
            assert ack.offset == held
        read = await store.read(M, "stdout", 0, 4 * KEEP_BYTES)
        assert read.next_offset == held
        kept = sum(len(p.data) for p in read.pieces)
        assert kept <= KEEP_BYTES
        assert read.dropped_bytes == held - kept
        cursor = 0
        for piece in read.pieces:
            # Each piece is the file's own bytes at its offset, in order, after any dropped gap.
            assert piece.offset == cursor + piece.dropped_before
            assert piece.data == FILE[piece.offset : piece.offset + len(piece.data)]
            cursor = piece.offset + len(piece.data)
        assert cursor == held
    finally:
        await store.close()
