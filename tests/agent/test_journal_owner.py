"""A Node runs only on its own journal: fresh ones are stamped, foreign or empty ones refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuneplane.agent.adapter import open_aio_host
from tuneplane.agent.journal_owner import open_node_journal, owner_problem
from tuneplane.agent.journal_records import JournalCorrupt


async def test_a_missing_journal_is_created_and_stamped_then_reopened(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    async with open_aio_host():
        journal = await open_node_journal(path, "node-a", 1)
        assert await journal.get_meta("node_id") == "node-a"
        await journal.close()
        again = await open_node_journal(path, "node-a", 2)
        await again.close()


async def test_another_nodes_journal_is_refused_without_being_written(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    async with open_aio_host():
        journal = await open_node_journal(path, "node-a", 1)
        await journal.close()
        before = path.read_bytes()
        with pytest.raises(JournalCorrupt, match="belongs to Node node-a, not to this Node"):
            await open_node_journal(path, "node-b", 2)
    assert path.read_bytes() == before


async def test_an_empty_journal_is_refused_and_left_empty(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    path.write_bytes(b"")
    async with open_aio_host():
        with pytest.raises(JournalCorrupt, match="is empty"):
            await open_node_journal(path, "node-a", 1)
    assert path.read_bytes() == b""


def test_owner_problem_names_the_file_and_both_nodes() -> None:
    path = Path("/var/lib/tuneplane-node/journal.db")
    assert owner_problem(path, "node-a", "node-a") is None
    unstamped = owner_problem(path, None, "node-a")
    assert unstamped is not None and str(path) in unstamped and "holds no Node id" in unstamped
    foreign = owner_problem(path, "node-b", "node-a")
    assert foreign is not None and "node-b" in foreign and "node-a" in foreign
