"""A damaged journal puts the agent in safe mode: it refuses new work with the reason, leaves a
running workload alone, writes nothing to the damaged file, and says so in status and doctor."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent.jobs import journal, submit, wait_job
from tests.faults.jobs import count_lines, runner_alive, wait_state
from tests.support.agent import start_agent, wait_until
from tests.support.coordinator import CoordinatorProcess, start_coordinator

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    with start_coordinator(tmp_path_factory.mktemp("safe")) as coord:
        yield coord


def _garble(path: Path) -> None:
    """Keep the header page, overwrite every later page: the tables no longer parse."""
    data = path.read_bytes()
    path.write_bytes(data[:4096] + b"\xa5" * (len(data) - 4096))


def _truncate(path: Path) -> None:
    """Cut the file mid-page, as a full disk or a bad copy would."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 - 100])


def _empty(path: Path) -> None:
    """A zero-length file where the journal was: not a fresh Node, a lost journal."""
    path.write_bytes(b"")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize(
    "damage", [_garble, _truncate, _empty], ids=["garbled", "truncated", "empty"]
)
def test_a_damaged_journal_means_safe_mode_and_the_running_member_is_left_alone(
    coordinator: CoordinatorProcess, tmp_path: Path, damage: object
) -> None:
    assert callable(damage)
    agent = start_agent(tmp_path, coordinator)
    agent.wait_connected()
    release = tmp_path / "release"
    script = (
        'echo started >> "$TUNEPLANE_OUT_DIR/starts"\n'
        f'while [ ! -e "{release}" ]; do sleep 0.1; done\n'
    )
    try:
        run_id = submit(coordinator, tmp_path / "proj", script)
        wait_state(coordinator, run_id, "running")
        (member,) = journal(agent, "members", "--json")
        member_dir, out_dir = Path(member["member_dir"]), Path(member["out_dir"])
        agent.stop()  # a clean stop checkpoints the WAL, so the damage below is all there is
        assert not agent.journal_path.with_name("journal.db-wal").exists()
        damage(agent.journal_path)
        before = _digest(agent.journal_path)

        agent.start()
        status = agent.wait_connected()
        assert status["safe_mode"], status
        assert "SAFE MODE" in status["safe_mode_reason"]
        assert str(agent.journal_path) in status["safe_mode_reason"]
        assert runner_alive(member_dir), "safe mode must not touch a running workload"

        text = agent.cli("status")
        assert "SAFE MODE" in text.stdout
        if damage is not _empty:
            assert "members: unknown (the journal cannot be read)" in text.stdout, text.stdout
        shown = json.loads(agent.cli("status", "--json").stdout)
        assert shown["safe_mode"] and shown["connected"]
        doctor = agent.cli("doctor")
        assert doctor.returncode == 1 and "FAIL  journal" in doctor.stdout, doctor.stdout

        # New work is refused with the reason, and the attempt is aborted rather than left hanging.
        second = submit(coordinator, tmp_path / "proj2", "exit 0\n")
        done = wait_job(coordinator, second, 60)
        assert done["state"] == "aborted", done
        assert "integrity check (safe mode)" in done["state_reason"], done["state_reason"]

        # The workload still finishes on its own terms; the agent neither restarts nor kills it.
        release.write_text("go")
        wait_until("the member's own exit record", lambda: (member_dir / "exit.json").exists())
        assert count_lines(out_dir / "starts") == 1
        assert _digest(agent.journal_path) == before, "safe mode must not write the damaged journal"
        assert agent.alive()
    finally:
        release.write_text("go")
        agent.stop()
