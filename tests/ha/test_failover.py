"""kill -9 the leading coordinator: the standby takes over, the Node and tp follow, nothing is
lost or done twice.

Two real ``serve`` processes share one real PostgreSQL database; a real agent runs a real Job
that writes a metric point every 0.1 s. The leader is SIGKILLed while the member runs and points
are being shipped. The standby takes the lease (its first decision says so), the Node reconnects
to it from the list the leader's Welcome gave it, the member is not started again, every point
arrives exactly once, the Job succeeds, and a new Job is admitted through the new leader. The
timings are printed (``-s``) for the record; the bench measures them (``nox -s bench``).
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from tests.agent.jobs import job, submit, tp, wait_job
from tests.support.agent import start_agent, wait_until
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.ha import start_standby

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

POINTS = 60
# One point every 0.1 s: the member runs about 6 s, long enough to kill the leader mid-run.
SCRIPT = f"""
for i in $(seq 0 {POINTS - 1}); do
  echo "{{\\"step\\": $i, \\"loss\\": $i.5}}" >> "$TUNEPLANE_TELEMETRY_DIR/m.jsonl"
  sleep 0.1
done
"""


def _refused(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return False
    except ConnectionRefusedError:
        return True


def _metrics(coord: CoordinatorProcess, *args: str) -> Any:
    return json.loads(tp(coord, "metrics", *args, "--json"))


@pytest.mark.usefixtures("pg_backend")
def test_kill_the_leader_mid_run_and_the_standby_finishes_the_job(tmp_path: Path) -> None:
    leader = start_coordinator(tmp_path / "a")
    standby = start_standby(leader, tmp_path / "b")
    agent = None
    try:
        agent = start_agent(tmp_path, leader)
        agent.wait_connected()
        # The Welcome named both coordinators; the Node keeps them in node.json.
        node = wait_until(
            "node.json to list both coordinators",
            lambda: (
                (n := json.loads((agent.state_dir / "node.json").read_text()))
                and len(n.get("coordinators", [])) == 2
                and n
            ),
        )
        standby_control = next(a for a in node["coordinators"] if a != leader.control)
        assert _refused(standby_control), "a standby must refuse connections until it leads"

        run_id = submit(leader, tmp_path / "proj", SCRIPT)
        wait_until("the member to run", lambda: job(leader, run_id)["state"] == "running")
        wait_until(
            "points to be shipped",
            lambda: sum(t["points"] for t in _metrics(leader, run_id)["tags"]) > 0,
        )

        # A second Job's project, ready to submit once the leader is gone.
        second_root = tmp_path / "proj2"
        second_root.mkdir()
        tp(leader, "init", str(second_root), "--name", "second", cwd=second_root)
        tp(leader, "new", "job", "--method", "custom/custom", cwd=second_root)
        (second_root / "experiments" / "job" / "train.sh").write_text("true\n")

        leader.kill()
        killed = time.monotonic()
        standby.wait_leading(timeout=30)
        took = time.monotonic() - killed
        assert standby.control == standby_control
        wait_until(
            "the Node to reconnect to the new leader",
            lambda: (
                (s := agent.status()).get("connected") and s.get("coordinator") == standby.control
            ),
        )
        reconnected = time.monotonic() - killed
        # tp with the dead leader's own context: it names both coordinators and follows.
        out = tp(leader, "submit", "job", "--profile", "h200:1", "--yes", "--json", cwd=second_root)
        second = str(json.loads(out.strip().splitlines()[-1])["run_id"])
        admitted = time.monotonic() - killed
        print(
            f"\ntakeover after kill -9: lead {took:.2f} s, Node back {reconnected:.2f} s, "
            f"admission {admitted:.2f} s"
        )

        shown_status = standby.admin("status")
        assert shown_status.returncode == 0, shown_status.stderr
        print(shown_status.stdout)
        leads = [line for line in shown_status.stdout.splitlines() if line.startswith("Leader:")]
        assert len(leads) == 1 and "(term 2)" in leads[0] and "expires in" in leads[0]
        (gone,) = [line for line in shown_status.stdout.splitlines() if " gone " in line]
        assert "seen" in gone, "the killed leader's session is gone, and status says so"

        assert wait_job(standby, run_id)["state"] == "succeeded"
        assert wait_job(standby, second)["state"] == "succeeded"
        shown = job(standby, run_id)
        assert len(shown["attempts"]) == 1, "the member was started again"
        # The first leader's own start is a takeover too (term 1, from nobody).
        first, taken = (d["detail"] for d in standby.decisions("coordinator took over"))
        assert (first["term"], first["from"]) == (1, "")
        assert taken["term"] == 2 and taken["from"] == first["coordinator"]
        assert taken["coordinator"] != taken["from"] and "session ended" in taken["why"]

        def drained() -> Any:
            members = _metrics(standby, run_id, "--delivery")["members"]
            return members if members and all(m["drained"] for m in members) else None

        wait_until("every point delivered", drained, timeout=60)
        series = _metrics(standby, run_id, "--tag", "loss", "--max-points", "1000")
        assert [b["first_step"] for b in series["buckets"]] == list(range(POINTS))
        assert [b["last"] for b in series["buckets"]] == [s + 0.5 for s in range(POINTS)]
    finally:
        if agent is not None and agent.alive():
            agent.stop()
        standby.stop()
        leader.kill()
