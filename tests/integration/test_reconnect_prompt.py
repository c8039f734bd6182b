"""A Node reconnects promptly when the coordinator comes back (agent/reconnect.py): a member
that finished while the coordinator was down leaves ``unknown`` within seconds of the
coordinator's return, however long the agent's backoff had grown; and a Node enrolled with
several coordinator addresses enrolls at the one that answers. Real coordinator and agent
processes over loopback TLS."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.agent.jobs import submit, wait_job
from tests.faults.jobs import pending_reports, wait_state
from tests.support.agent import node_cli, start_agent, wait_until
from tests.support.coordinator import start_coordinator

pytestmark = pytest.mark.slow

# A long heartbeat timeout: the backoff's cap (a third of it, 10 s) lets the waits grow as in a
# real outage, so only the probe can bring the Node back within the bound below.
HEARTBEAT_TIMEOUT_S = 30.0
# Rounds failed before the coordinator comes back: the wait's window is then the cap, 10 s.
FAILED_ROUNDS = 6
# Generous on a loaded 2-core machine; it measures well under a second when idle.
PROMPT_S = 5.0


def _held_script(release: Path) -> str:
    return f'while [ ! -e "{release}" ]; do sleep 0.1; done\necho done > "$TUNEPLANE_OUT_DIR/r"\n'


def test_a_finished_member_leaves_unknown_promptly_after_the_coordinator_is_back(
    tmp_path: Path,
) -> None:
    with start_coordinator(tmp_path, heartbeat_timeout=HEARTBEAT_TIMEOUT_S) as coord:
        agent = start_agent(tmp_path, coord)
        release = tmp_path / "release"
        try:
            agent.wait_connected()
            run_id = submit(coord, tmp_path / "proj", _held_script(release))
            wait_state(coord, run_id, "running")

            # The coordinator goes away; the member finishes while it is gone.
            coord.stop()
            release.write_text("go")
            wait_until(
                "the exit report to wait in the journal",
                lambda: any(r["state"] == "exited" for r in pending_reports(agent)),
            )
            wait_until(
                f"the agent's backoff to reach round {FAILED_ROUNDS}",
                lambda: f"failed_rounds={FAILED_ROUNDS}" in agent.read_log(),
                60,
            )

            coord.restart()
            back_ms = time.time() * 1000
            done = wait_job(coord, run_id)
            assert done["state"] == "succeeded", done
            states = [(c["state"], c["at_ms"]) for c in done["history"]]
            last = max(i for i, (state, _) in enumerate(states) if state == "unknown")
            took_s = max(states[last + 1][1] - back_ms, 0) / 1000
            print(f"unknown left {took_s:.2f} s after the coordinator was ready")
            assert took_s < PROMPT_S, (states, back_ms)
            assert "Traceback" not in agent.read_log()
        finally:
            release.write_text("go")
            agent.stop()


def _nobody_listens() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return f"127.0.0.1:{port}"


def test_enroll_with_several_coordinators_enrolls_at_the_one_that_answers(
    tmp_path: Path,
) -> None:
    with start_coordinator(tmp_path) as coord:
        standby = _nobody_listens()
        state = tmp_path / "node"
        done = subprocess.run(
            node_cli(
                "enroll", "--state-dir", str(state),
                "--coordinator", standby, "--coordinator", f"{coord.control},{standby}",
                "--ca", str(coord.ca_path), "--token", coord.create_join_token(),
                "--simulate-gpus", "h200:2",
            ),
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        node = json.loads((state / "node.json").read_text())
        assert node["coordinator"] == coord.control
        assert node["coordinators"] == [standby, coord.control]

        bad = subprocess.run(
            node_cli(
                "enroll", "--state-dir", str(tmp_path / "other"), "--coordinator", "a:1,b",
                "--ca", str(coord.ca_path), "--token", "x",
            ),
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert bad.returncode == 1
        assert "'b' is not HOST:PORT" in bad.stderr and "Traceback" not in bad.stderr


def test_a_dead_address_first_in_the_list_costs_no_backoff(tmp_path: Path) -> None:
    # A standby (nobody listens) is dialed first; the leader after it is dialed at once, in
    # the same round. A single coordinator names no list: the one the Node had is kept.
    with start_coordinator(tmp_path) as coord:
        agent = start_agent(tmp_path, coord)
        try:
            agent.wait_connected()
            agent.stop()
            standby = _nobody_listens()
            node_file = agent.state_dir / "node.json"
            node = json.loads(node_file.read_text())
            node["coordinator"], node["coordinators"] = standby, [standby, coord.control]
            node_file.write_text(json.dumps(node))
            logged = len(agent.read_log())
            agent.restart()
            assert agent.wait_connected()["coordinator"] == coord.control
            since = agent.read_log()[logged:]
            assert f"control session ended coordinator={standby}" in since
            assert "reconnecting coordinator=" not in since, since
            assert json.loads(node_file.read_text())["coordinators"] == [standby, coord.control]
        finally:
            agent.stop()
