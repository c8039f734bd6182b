"""The on-call's commands work beside a running daemon, with the daemon killed and with the
coordinator gone, and they never write the journal (read-only ``mode=ro``, never immutable)."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from tests.agent.jobs import journal, submit
from tests.faults.jobs import wait_state
from tests.support.agent import node_cli, start_agent, wait_until
from tests.support.coordinator import start_coordinator

pytestmark = pytest.mark.slow


def _files(state_dir: Path) -> dict[str, str]:
    """Digest of the journal and its WAL: any write by a reader would change one of them."""
    found = {}
    for name in ("journal.db", "journal.db-wal"):
        path = state_dir / name
        if path.exists():
            found[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def test_the_journal_commands_read_live_state_and_work_with_everything_down(
    tmp_path: Path,
) -> None:
    coordinator = start_coordinator(tmp_path)
    agent = start_agent(tmp_path, coordinator)
    release = tmp_path / "release"
    try:
        agent.wait_connected()
        script = f'while [ ! -e "{release}" ]; do sleep 0.1; done\n'
        run_id = submit(coordinator, tmp_path / "proj", script)
        wait_state(coordinator, run_id, "running")
        key = f"{run_id}.1.0"

        # Beside the running daemon: the latest transition is in the WAL, not yet in
        # journal.db; a reader opened with immutable=1 would not see it.
        assert (agent.state_dir / "journal.db-wal").stat().st_size > 0
        (member,) = wait_until(
            "the journal to say running",
            lambda: [m for m in journal(agent, "members", "--json") if m["state"] == "running"],
        )
        assert member["member"] == key and member["gpu_indexes"] == [0]
        kinds = [e["kind"] for e in journal(agent, "events", "--member", key, "--json")]
        assert kinds[-1] == "runner-started"
        held = journal(agent, "reservations", "--json")["gpus"]
        assert [(g["gpu_index"], g["member"], g["state"]) for g in held] == [(0, key, "running")]
        live = json.loads(agent.cli("status", "--json").stdout)
        assert live["agent_running"] and live["connected"]
        assert live["last_heartbeat_ack_ms"] and live["pending_reports"] == 0

        # Now everything is down: the coordinator is killed, then the agent (SIGKILL, so its
        # WAL is left behind un-checkpointed, exactly as after a crash).
        coordinator.kill()
        wait_until("the agent to notice", lambda: not agent.status().get("connected"), 15)
        agent.kill()
        before = _files(agent.state_dir)
        assert "journal.db-wal" in before

        status = agent.cli("status")
        assert status.returncode == 0, status.stderr
        assert "agent: NOT RUNNING" in status.stdout
        assert "last heartbeat ack before it stopped: " in status.stdout
        assert f"{key}  running  gpus [0]" in status.stdout
        assert "GPUs (simulated): 2" in status.stdout
        assert f"GPU-sim-node-a-0  Simulated H200  healthy  {key}" in status.stdout
        assert journal(agent, "members", "--json")[0]["state"] == "running"
        show = journal(agent, "show", key)
        assert "runner-started" in show and "starting -> running" in show
        assert journal(agent, "events", "--since", "10m", "--json")
        assert journal(agent, "events", "--since", "2999-01-01T00:00", "--json") == []
        text = journal(agent, "reservations")
        assert key in text and "pending reports: 0" in text
        export = journal(agent, "export", "--json")
        assert set(export) >= {"meta", "members", "reservations", "pending_reports", "events"}
        assert export["meta"]["node_id"] == agent.node_id
        token = (agent.state_dir / "credentials" / "control.token").read_text().strip()
        assert token and token not in json.dumps(export)
        doctor = agent.cli("doctor")
        assert "ok    journal integrity" in doctor.stdout, doctor.stdout
        assert _files(agent.state_dir) == before, "an on-call command wrote the journal"

        bad = agent.cli("journal", "show", "run-nope.1.0")
        assert bad.returncode == 1 and "is not in this journal" in bad.stderr
        since = agent.cli("journal", "events", "--since", "yesterday")
        assert since.returncode == 2 and "neither a duration" in since.stderr
    finally:
        release.write_text("go")
        if agent.alive():
            agent.kill()
        coordinator.kill()


def test_the_journal_commands_explain_a_missing_journal(tmp_path: Path) -> None:
    state_dir = tmp_path / "nowhere"
    done = subprocess.run(
        node_cli("journal", "members", "--state-dir", str(state_dir)),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    assert "There is no journal at" in done.stderr and "--state-dir" in done.stderr
