"""What the daemon does with the coordinators a Welcome names (agent/daemon_session.py): it
stores them in node.json (atomically) and journals the change before the next round dials
them; a list with an address that is not HOST:PORT changes nothing. A real state directory and a
real journal; no coordinator is needed to carry out the effect."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuneplane.agent import journal_read
from tuneplane.agent.adapter import open_aio_host
from tuneplane.agent.cli_gpu_source import gpu_source
from tuneplane.agent.config import WorkloadPolicy
from tuneplane.agent.daemon_session import DaemonSession
from tuneplane.agent.journal import Journal
from tuneplane.agent.journal_records import CONTROL_ADDRESS_CHANGED
from tuneplane.agent.session import AdoptCoordinators
from tuneplane.agent.state_dir import NodeConfig, StateDir

pytestmark = pytest.mark.timeout(60)

NODE = NodeConfig("node-1", "default", "a:7444", "gpu-a", "/ca.pem", 1)


def _daemon(tmp_path: Path) -> DaemonSession:
    state = StateDir(tmp_path / "state")
    state.create()
    state.save_node(NODE)
    source = gpu_source("gpu-a", "h200:1", None)
    return DaemonSession(
        state, NODE, "credential", source, tmp_path / "out",
        work_root=tmp_path / "work", policy=WorkloadPolicy("agent"),
    )  # fmt: skip


def _changes(daemon: DaemonSession) -> list[dict[str, object]]:
    with journal_read.open_readonly(daemon.state.journal_path) as db:
        return journal_read.events(db, kinds=[CONTROL_ADDRESS_CHANGED])


async def test_a_named_list_is_stored_and_journaled_once(tmp_path: Path) -> None:
    daemon = _daemon(tmp_path)
    async with open_aio_host():
        daemon.journal = await Journal.open(daemon.state.journal_path)
        try:
            await daemon._execute([AdoptCoordinators(("b:7444", "a:7444"))])
            await daemon._execute([AdoptCoordinators(("b:7444", "a:7444"))])
            # One coordinator names none: the list the Node had is kept, nothing journaled.
            await daemon._execute([AdoptCoordinators(())])
        finally:
            await daemon.journal.close()
    stored = daemon.state.load_node()
    assert stored.coordinators == ("b:7444", "a:7444") == daemon.node.coordinators
    assert stored.coordinator == "a:7444"
    (change,) = _changes(daemon)
    assert change["details"] == {"old_coordinators": [], "coordinators": ["b:7444", "a:7444"]}
    assert "b:7444, a:7444" in str(change["reason"])


async def test_a_list_with_a_bad_address_changes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    daemon = _daemon(tmp_path)
    async with open_aio_host():
        daemon.journal = await Journal.open(daemon.state.journal_path)
        try:
            await daemon._execute([AdoptCoordinators(("b:7444", "c"))])
        finally:
            await daemon.journal.close()
    assert daemon.state.load_node() == NODE == daemon.node
    assert not _changes(daemon)
    assert "'c' among the coordinators sharing its store, which is not HOST:PORT" in caplog.text
