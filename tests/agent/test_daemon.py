"""The daemon against a real coordinator: connect, heartbeats, reconnect, journal-first launch."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent.jobs import job, journal, submit, wait_job
from tests.support.agent import start_agent, wait_until
from tests.support.coordinator import CoordinatorProcess, start_coordinator

pytestmark = pytest.mark.slow


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[CoordinatorProcess]:
    with start_coordinator(tmp_path) as coord:
        yield coord


def test_connects_and_heartbeats(coordinator: CoordinatorProcess, tmp_path: Path) -> None:
    agent = start_agent(tmp_path, coordinator)
    try:
        agent.wait_connected()
        first = wait_until("a heartbeat ack", lambda: agent.status().get("last_heartbeat_ack_ms"))
        later = wait_until(
            "a later heartbeat ack",
            lambda: (agent.status().get("last_heartbeat_ack_ms") or 0) > first,
        )
        assert later
        status = json.loads(agent.cli("status", "--json").stdout)
        assert status["connected"] and status["node_id"] == agent.node_id
        assert [g["uuid"] for g in status["inventory"]["gpus"]] == [
            "GPU-sim-node-a-0", "GPU-sim-node-a-1",
        ]  # fmt: skip
        assert "control stream opened node=" + agent.node_id in coordinator.read_log()
    finally:
        agent.stop()
    text = agent.cli("status").stdout
    assert "NOT RUNNING" in text


def test_reconnects_with_backoff_when_the_coordinator_comes_back(
    coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    agent = start_agent(tmp_path, coordinator)
    try:
        agent.wait_connected()
        coordinator.kill()
        wait_until("the agent to notice", lambda: not agent.status().get("connected"), 15)
        # Give the agent a few failed attempts so the backoff grows past its first step.
        wait_until("reconnect attempts", lambda: agent.status().get("reconnects", 0) >= 3, 15)
        assert agent.alive()
        coordinator.restart()
        agent.wait_connected(45)
        log = agent.read_log()
        assert "reconnecting coordinator=" in log
        delays = [float(part.split("=")[1]) for line in log.splitlines()
                  for part in line.split() if part.startswith("in_s=")]  # fmt: skip
        assert max(delays) > min(delays), delays
    finally:
        agent.stop()


def test_a_job_runs_and_the_journal_tells_its_story(
    coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    agent = start_agent(tmp_path, coordinator)
    try:
        agent.wait_connected()
        script = 'echo "$CUDA_VISIBLE_DEVICES" > "$TUNEPLANE_OUT_DIR/gpu"\n'
        run_id = submit(coordinator, tmp_path / "proj", script)
        done = wait_job(coordinator, run_id)
        assert done["state"] == "succeeded", done
        wait_until(
            "reports acknowledged",
            lambda: not journal(agent, "reservations", "--json")["pending_reports"],
        )
        key = f"{run_id}.1.0"
        (member,) = journal(agent, "members", "--json")
        assert member["member"] == key and member["state"] == "exited"
        assert member["exit_code"] == 0
        gpu = (Path(member["out_dir"]) / "gpu").read_text().strip()
        assert gpu.startswith("GPU-sim-node-a-")
        kinds = [e["kind"] for e in journal(agent, "events", "--member", key, "--json")]
        assert kinds == [
            "prepare-received", "prepare-succeeded", "commit-received", "spawn-requested",
            "runner-started", "exit-observed",
        ]  # fmt: skip
        assert journal(agent, "reservations", "--json")["gpus"] == []
        show = journal(agent, "show", key)
        assert "exit-observed" in show and "running -> exited" in show
    finally:
        agent.stop()
    # The journal reads the same with the daemon stopped.
    assert journal(agent, "members", "--json")[0]["state"] == "exited"
    assert journal(agent, "events", "--since", "1h", "--json")


def test_stopping_the_agent_leaves_the_member_running(
    coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    agent = start_agent(tmp_path, coordinator)
    agent.wait_connected()
    marker = tmp_path / "release"
    script = f'while [ ! -e "{marker}" ]; do sleep 0.1; done\necho done > "$TUNEPLANE_OUT_DIR/r"\n'
    run_id = submit(coordinator, tmp_path / "proj", script)
    wait_until("the member to run", lambda: job(coordinator, run_id)["state"] == "running")
    agent.stop()
    (member,) = journal(agent, "members", "--json")
    assert member["state"] == "running"
    runner = json.loads((Path(member["member_dir"]) / "runner.json").read_text())
    os.kill(int(runner["pid"]), 0)  # still alive without its agent
    marker.write_text("go")
    # The member finishes while the agent is down; the restarted agent collects the exit.
    wait_until("the exit record", lambda: (Path(member["member_dir"]) / "exit.json").exists())
    try:
        agent.restart()
        done = wait_job(coordinator, run_id)
        assert done["state"] == "succeeded", done
        assert (Path(member["out_dir"]) / "r").read_text() == "done\n"
    finally:
        agent.stop()


def test_a_corrupt_journal_means_safe_mode(coordinator: CoordinatorProcess, tmp_path: Path) -> None:
    agent = start_agent(tmp_path, coordinator)
    agent.wait_connected()
    agent.stop()
    data = agent.journal_path.read_bytes()
    agent.journal_path.write_bytes(data[:4096] + b"\xff" * (len(data) - 4096))
    try:
        agent.start()
        status = agent.wait_connected()
        assert status["safe_mode"] and "SAFE MODE" in status["safe_mode_reason"]
        assert "SAFE MODE" in agent.cli("status").stdout
        assert "safe mode reason=" in agent.read_log()
        doctor = agent.cli("doctor")
        assert doctor.returncode == 1 and "FAIL  journal" in doctor.stdout
        # What NVML says depends on the machine (no library here, GPUs on a GPU host).
        assert re.search(r"^(ok  |FAIL)  NVML", doctor.stdout, re.MULTILINE), doctor.stdout
        started = time.monotonic()
        # Prepare is refused with the reason, so the Job does not run here.
        run_id = submit(coordinator, tmp_path / "proj", "exit 0\n")
        done = wait_job(coordinator, run_id, 60)
        assert done["state"] != "succeeded"
        assert time.monotonic() - started < 60
    finally:
        agent.stop()


def test_a_silent_coordinator_is_dropped_after_the_heartbeat_timeout(
    coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    agent = start_agent(tmp_path, coordinator)
    try:
        agent.wait_connected()
        # SIGSTOP keeps the TCP connection open but silent: only the heartbeat timeout notices.
        os.kill(coordinator.pid, signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            wait_until("the agent to drop the silent stream",
                       lambda: not agent.status().get("connected"), 15)  # fmt: skip
            assert time.monotonic() - stopped >= 2.5  # the coordinator's timeout is 3 s
            assert "heard nothing from the coordinator for" in agent.read_log()
        finally:
            os.kill(coordinator.pid, signal.SIGCONT)
        agent.wait_connected(45)
    finally:
        agent.stop()
