"""A leader that is paused (SIGSTOP) loses its lease, is fenced when it wakes, and rejoins as a
standby; killing the new leader then hands the lease back to it.

Real processes on one real PostgreSQL database, with a short lease ([leader] in
coordinator.toml) so the test is quick. While the old leader sleeps, its process and its
database session live on: the standby takes over only when the lease expires, and the Node
leaves the silent leader on its heartbeat timeout. When the old leader wakes it must not act:
it steps down (its renewal finds another term, or a write fails its fence), closes its
listeners, and stands by. Nothing it could have decided is kept: the Job it was running is
decided once, by the new leader.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.agent.jobs import job, submit, wait_job
from tests.support.agent import start_agent, wait_until
from tests.support.coordinator import start_coordinator
from tests.support.ha import start_standby

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

LEASE = "\n[leader]\nttl_s = 2\nrenew_s = 0.5\npoll_s = 0.25\n"


def _status(coordinator_dir: Path) -> dict[str, Any]:
    """``tuneplane-coordinator status --json``, run for real."""
    done = subprocess.run(
        [sys.executable, "-m", "tuneplane.coordinator.cli.admin", "status", "--state-dir",
         str(coordinator_dir), "--json"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    found: dict[str, Any] = json.loads(done.stdout)
    return found


@pytest.mark.usefixtures("pg_backend")
def test_a_paused_leader_is_fenced_when_it_wakes_and_rejoins_as_a_standby(tmp_path: Path) -> None:
    old = start_coordinator(tmp_path / "a", config=LEASE)
    new = start_standby(old, tmp_path / "b")
    agent = None
    try:
        agent = start_agent(tmp_path, old)
        agent.wait_connected()
        wait_until(
            "the Node to learn both coordinators",
            lambda: (
                len(json.loads((agent.state_dir / "node.json").read_text())["coordinators"]) == 2
            ),
        )
        run_id = submit(old, tmp_path / "proj", "sleep 10\n")
        wait_until("the member to run", lambda: job(old, run_id)["state"] == "running")
        logged = len(old.read_log())

        os.kill(old.pid, signal.SIGSTOP)  # paused: alive, connected, silent
        try:
            new.wait_leading(timeout=30)
            wait_until(
                "the Node to move to the new leader",
                lambda: (
                    (s := agent.status()).get("connected") and s.get("coordinator") == new.control
                ),
                timeout=60,
            )
            # The member ends while the old leader sleeps; the new one decides the Job.
            assert wait_job(new, run_id)["state"] == "succeeded"
        finally:
            os.kill(old.pid, signal.SIGCONT)

        after = old.wait_log("stepped down", timeout=30, after=logged)
        old.wait_log("standing by", timeout=30, after=after)
        assert "Traceback" not in old.read_log()[logged:]
        status = _status(new.state_dir)
        roles = {c["id"]: c["role"] for c in status["coordinators"]}
        assert sorted(roles.values()) == ["leader", "standby"] and status["term"] == 2
        # Decided once, by the new leader: one attempt, one end.
        shown = job(new, run_id)
        assert len(shown["attempts"]) == 1 and shown["state"] == "succeeded"
        ends = [
            d
            for d in new.decisions("job state")
            if d["run_id"] == run_id and d["detail"].get("to") == "succeeded"
        ]
        assert len(ends) <= 1

        # The old leader, healed, is a standby like any other: it takes over when the new one dies.
        new.kill()
        old.wait_leading(timeout=30)
        wait_until(
            "the Node to come back to the old leader",
            lambda: (s := agent.status()).get("connected") and s.get("coordinator") == old.control,
            timeout=60,
        )
        terms = [d["detail"]["term"] for d in old.decisions("coordinator took over")]
        assert terms == [1, 2, 3]
    finally:
        if agent is not None and agent.alive():
            agent.stop()
        new.kill()
        old.kill()
