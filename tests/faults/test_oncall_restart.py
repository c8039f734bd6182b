"""The on-call's restart questions, answered from the journal of a real agent killed with -9.

A Node holds two members; its agent is killed (SIGKILL) while one member keeps running and the
other exits; the coordinator is stopped too, and the agent restarted. Its journal must then say:
the previous run did not stop cleanly (and when it last wrote), which live member it re-attached
(runner pid and start time as the runner recorded them), which exit it collected (pid, code,
when), and which report the coordinator has not heard yet, until a coordinator acknowledges it.
A SIGTERM stop, then a start, reads as clean.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.agent.jobs import journal, submit, wait_job
from tests.faults.jobs import runner_alive, wait_state
from tests.support.agent import AgentProcess, start_agent, wait_until
from tests.support.coordinator import start_coordinator

pytestmark = pytest.mark.slow


def _held(release: Path, then: str = "") -> str:
    return f'while [ ! -e "{release}" ]; do sleep 0.1; done\n{then}'


def _starts(agent: AgentProcess) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = journal(
        agent, "events", "--node", "--kind", "agent-started", "--json"
    )
    return rows


def _started_again(agent: AgentProcess, before: int) -> dict[str, Any]:
    """The agent-started event of the run that began after ``before`` starts were journaled."""
    found: list[dict[str, Any]] = wait_until(
        "the agent to journal its start",
        lambda: (rows := _starts(agent))[before:] and rows,
    )
    (start,) = found[before:]
    assert start["details"]["pid"] == agent.pid
    return start


def _events(agent: AgentProcess, kind: str, key: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = journal(agent, "events", "--kind", kind, "--member", key, "--json")
    return rows


@pytest.mark.timeout(420)
def test_a_killed_agent_journals_its_unclean_stop_reattach_and_collected_exit(
    tmp_path: Path,
) -> None:
    coordinator = start_coordinator(tmp_path)
    agent = start_agent(tmp_path, coordinator)
    keep, end = tmp_path / "keep-release", tmp_path / "end-release"
    try:
        agent.wait_connected()
        kept_run = submit(coordinator, tmp_path / "kept", _held(keep))
        ended_run = submit(coordinator, tmp_path / "ended", _held(end, "exit 3\n"))
        wait_state(coordinator, kept_run, "running")
        wait_state(coordinator, ended_run, "running")
        dirs = {m["run_id"]: Path(m["member_dir"]) for m in journal(agent, "members", "--json")}
        kept_dir, ended_dir = dirs[kept_run], dirs[ended_run]
        kept_key, ended_key = f"{kept_run}.1.0", f"{ended_run}.1.0"
        kept_runner = json.loads((kept_dir / "runner.json").read_text())
        ended_runner = json.loads((ended_dir / "runner.json").read_text())
        (first,) = _starts(agent)
        assert first["details"]["previous_stop"] == "first"
        assert first["details"]["state_dir"] == str(agent.state_dir)

        killed_at_ms = int(time.time() * 1000)
        agent.kill()
        assert runner_alive(kept_dir) and runner_alive(ended_dir)
        end.write_text("go")
        wait_until("the runner's exit record", lambda: (ended_dir / "exit.json").exists())
        exit_record = json.loads((ended_dir / "exit.json").read_text())
        # The coordinator is down too: what the restarted agent reports must wait, journaled.
        coordinator.stop()
        agent.start()
        start = _started_again(agent, 1)
        assert start["details"]["previous_stop"] == "unclean", start
        last = start["details"]["last_event_at_ms"]
        assert last is not None and first["at_ms"] <= last <= killed_at_ms
        assert "did not stop cleanly" in start["reason"]

        wait_until(
            "the collected exit",
            lambda: [m for m in journal(agent, "members", "--json") if m["state"] == "exited"],
        )
        (reattached,) = _events(agent, "member-reattached", kept_key)
        assert reattached["details"] == {
            "runner_pid": kept_runner["pid"], "runner_start_time": kept_runner["start_time"]
        }  # fmt: skip
        assert f"runner pid {kept_runner['pid']}" in reattached["reason"]
        assert _events(agent, "member-reattached", ended_key) == []
        (collected,) = _events(agent, "exit-collected", ended_key)
        assert collected["details"] == {
            "runner_pid": ended_runner["pid"], "exit_code": 3, "signal": None,
            "exited_at_ms": int(exit_record["finished_at"] * 1000),
        }  # fmt: skip
        assert _events(agent, "exit-collected", kept_key) == []
        assert runner_alive(kept_dir), "the restart must leave the live member running"

        pending = journal(agent, "pending", "--json")
        assert [(p["member"], p["state"], p["exit_code"]) for p in pending] == [
            (ended_key, "exited", 3)
        ], pending
        assert "exit code 3" in journal(agent, "pending")

        coordinator.restart()
        wait_until(
            "the coordinator to acknowledge", lambda: journal(agent, "pending", "--json") == []
        )
        assert journal(agent, "pending").strip() == "(none)"
        done = wait_job(coordinator, ended_run)
        assert done["state"] == "failed" and "exited with code 3" in done["state_reason"], done

        # An orderly stop (SIGTERM) writes the marker; the next start reads it as clean.
        agent.stop()
        stopped = journal(agent, "events", "--node", "--kind", "agent-stopped", "--json")
        assert stopped[-1]["reason"] == "orderly stop"
        agent.start()
        again = _started_again(agent, 2)
        assert again["details"]["previous_stop"] == "clean", again
        assert again["details"]["stopped_at_ms"] == stopped[-1]["at_ms"]
        assert "stopped cleanly" in again["reason"]
        assert len(_events(agent, "member-reattached", kept_key)) == 2
        keep.write_text("go")
        assert wait_job(coordinator, kept_run)["state"] == "succeeded"
        assert _events(agent, "exit-collected", kept_key) == [], "seen live, not collected"
    finally:
        keep.write_text("go")
        end.write_text("go")
        if agent.alive():
            agent.stop()
        coordinator.kill()


@pytest.mark.timeout(240)
def test_a_runner_found_alive_before_its_start_was_journaled_is_reattached(
    tmp_path: Path,
) -> None:
    # The agent dies right after the runner started and before `runner-started` is journaled:
    # the restarted agent finds the member `starting` with a live runner, and says it
    # re-attached it rather than starting it again.
    coordinator = start_coordinator(tmp_path)
    agent = start_agent(tmp_path, coordinator, env={"TUNEPLANE_CRASHPOINT": "after-spawn"})
    release = tmp_path / "release"
    try:
        agent.wait_connected()
        run_id = submit(coordinator, tmp_path / "proj", _held(release))
        assert agent.wait_exit(60) == 137
        key = f"{run_id}.1.0"
        (member,) = journal(agent, "members", "--json")
        assert member["state"] == "starting"
        runner = json.loads((Path(member["member_dir"]) / "runner.json").read_text())
        agent.start()
        start = _started_again(agent, 1)
        assert start["details"]["previous_stop"] == "unclean"
        wait_state(coordinator, run_id, "running")
        (reattached,) = _events(agent, "member-reattached", key)
        assert reattached["details"]["runner_pid"] == runner["pid"]
        assert reattached["details"]["runner_start_time"] == runner["start_time"]
        kinds = [e["kind"] for e in journal(agent, "events", "--member", key, "--json")]
        assert kinds.count("spawn-requested") == 1
        assert kinds.index("member-reattached") < kinds.index("runner-started")
        release.write_text("go")
        assert wait_job(coordinator, run_id)["state"] == "succeeded"
        assert _events(agent, "exit-collected", key) == []
    finally:
        release.write_text("go")
        if agent.alive():
            agent.stop()
        coordinator.kill()
