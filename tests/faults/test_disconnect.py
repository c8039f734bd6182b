"""A cut control connection during a running Job: the member runs on, the coordinator says
``unknown`` (never ``failed``), and the reports the agent could not deliver are replayed."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent.jobs import journal, submit, wait_job
from tests.faults.jobs import (
    count_lines,
    held_gpus,
    node,
    pending_reports,
    runner_alive,
    wait_state,
)
from tests.support.agent import start_agent, wait_until
from tests.support.coordinator import CoordinatorProcess, start_coordinator

pytestmark = pytest.mark.slow

HEARTBEAT_TIMEOUT_S = 3.0


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[CoordinatorProcess]:
    with start_coordinator(tmp_path, heartbeat_timeout=HEARTBEAT_TIMEOUT_S) as coord:
        yield coord


def _held_script(release: Path) -> str:
    return (
        'echo started >> "$TUNEPLANE_OUT_DIR/starts"\n'
        f'while [ ! -e "{release}" ]; do sleep 0.1; done\n'
        'echo done > "$TUNEPLANE_OUT_DIR/result"\n'
    )


def test_a_cut_longer_than_the_heartbeat_timeout_never_fails_the_job(
    coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    agent = start_agent(tmp_path, coordinator)
    agent.wait_connected()
    release = tmp_path / "release"
    run_id = submit(coordinator, tmp_path / "proj", _held_script(release))
    wait_state(coordinator, run_id, "running")
    (member,) = journal(agent, "members", "--json")
    member_dir, out_dir = Path(member["member_dir"]), Path(member["out_dir"])
    try:
        # 1. The agent goes silent (SIGSTOP) for longer than the heartbeat timeout: the
        # coordinator drops the Node and can no longer vouch for the member - unknown, not failed.
        os.kill(agent.pid, signal.SIGSTOP)
        try:
            wait_until(
                "the Node to be disconnected",
                lambda: not node(coordinator, agent.node_id)["connected"],
                15,
            )
            assert node(coordinator, agent.node_id)["disconnected_since_ms"] > 0
            shown = wait_state(coordinator, run_id, "unknown", 15)
            assert "disconnected" in shown["state_reason"]
            assert runner_alive(member_dir), "the cut must not touch the member"
        finally:
            os.kill(agent.pid, signal.SIGCONT)
        agent.wait_connected(30)
        wait_state(coordinator, run_id, "running", 15)
        assert runner_alive(member_dir)

        # 2. The coordinator goes silent while the member finishes: the agent journals the exit
        # and holds its report until a coordinator acknowledges it.
        os.kill(coordinator.pid, signal.SIGSTOP)
        try:
            wait_until(
                "the agent to drop the silent coordinator",
                lambda: not agent.status().get("connected"),
                15,
            )
            release.write_text("go")

            def exit_pending() -> bool:
                return any(r["state"] == "exited" for r in pending_reports(agent))

            wait_until("the exit report to wait in the journal", exit_pending, 15)
            assert journal(agent, "members", "--json")[0]["state"] == "exited"
        finally:
            os.kill(coordinator.pid, signal.SIGCONT)

        done = wait_job(coordinator, run_id)
        assert done["state"] == "succeeded", done
        assert "failed" not in [change["state"] for change in done["history"]]
        (shown_member,) = done["attempts"][0]["members"]
        assert shown_member["has_exit"] and shown_member["exit_code"] == 0
        wait_until("every report acknowledged", lambda: not pending_reports(agent))
        assert count_lines(out_dir / "starts") == 1
        assert (out_dir / "result").read_text() == "done\n"
    finally:
        release.write_text("go")
        agent.stop()


def test_a_member_that_exits_while_the_agent_is_killed_is_collected_and_reported(
    coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    agent = start_agent(tmp_path, coordinator)
    agent.wait_connected()
    release = tmp_path / "release"
    script = _held_script(release) + "exit 7\n"
    run_id = submit(coordinator, tmp_path / "proj", script)
    wait_state(coordinator, run_id, "running")
    (member,) = journal(agent, "members", "--json")
    member_dir, out_dir = Path(member["member_dir"]), Path(member["out_dir"])
    agent.kill()  # SIGKILL: no cleanup, no goodbye on the stream
    try:
        assert runner_alive(member_dir), "killing the agent must not kill the member"
        release.write_text("go")
        wait_until("the runner's exit record", lambda: (member_dir / "exit.json").exists())
        assert journal(agent, "members", "--json")[0]["state"] == "running"
        agent.restart()
        done = wait_job(coordinator, run_id)
        assert done["state"] == "failed", done
        assert "exited with code 7" in done["state_reason"]
        (shown,) = done["attempts"][0]["members"]
        assert shown["has_exit"] and shown["exit_code"] == 7
        (after,) = journal(agent, "members", "--json")
        assert after["state"] == "exited" and after["exit_code"] == 7
        assert count_lines(out_dir / "starts") == 1
        assert "replay re-attaches member=" in agent.read_log()
    finally:
        release.write_text("go")
        agent.stop()


def test_the_coordinator_killed_mid_prepare_converges_without_leaking_a_gpu(
    tmp_path: Path,
) -> None:
    # A long heartbeat timeout, so the SIGSTOPped agent stays connected while the Prepare is
    # queued to it; a short prepare timeout, so an attempt the restarted coordinator cannot
    # finish is aborted quickly.
    with start_coordinator(tmp_path, heartbeat_timeout=20, prepare_timeout=8) as coordinator:
        agent = start_agent(tmp_path, coordinator)
        agent.wait_connected()
        os.kill(agent.pid, signal.SIGSTOP)
        stopped = True
        try:
            script = 'echo started >> "$TUNEPLANE_OUT_DIR/starts"\n'
            run_id = submit(coordinator, tmp_path / "proj", script)
            wait_until(
                "the launch to be reserved",
                lambda: f"launch reserved run_id={run_id}" in coordinator.read_log(),
            )
            # The Prepare is on its way to a Node that has not answered: kill the coordinator.
            coordinator.kill()
            os.kill(agent.pid, signal.SIGCONT)
            stopped = False
            # Let the agent read what was queued to it and see the stream end before the restart.
            wait_until(
                "the agent to see the stream end", lambda: not agent.status().get("connected"), 15
            )
            coordinator.restart()
            agent.wait_connected(45)
            done = wait_job(coordinator, run_id, 60)
            assert done["state"] in ("succeeded", "aborted"), done
            (member,) = done["attempts"][0]["members"]
            wait_until("no GPU held on the Node", lambda: not held_gpus(agent), 30)
            wait_until("every report acknowledged", lambda: not pending_reports(agent), 30)
            shown = node(coordinator, agent.node_id)
            assert shown["connected"]
            assert len(shown["gpus"]) == 2 and not [g for g in shown["gpus"] if g["held_by"]]
            if done["state"] == "succeeded":
                assert count_lines(Path(member["out_dir"]) / "starts") == 1
            else:
                assert not (Path(member["out_dir"]) / "starts").exists()
        finally:
            if stopped:
                os.kill(agent.pid, signal.SIGCONT)
            agent.stop()
