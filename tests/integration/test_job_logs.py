"""`tp logs` through real processes: shipped by the Node, stored bounded, followed live.

One coordinator and one agent (two simulated h200) as separate processes on loopback TLS; the
agent is killed with SIGKILL and started again mid-Job to show that shipping resumes from its
journal without duplicating a byte.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.lifecycle_support import (
    member_running,
    project,
    submit,
    wait_job,
    wait_state,
)
from tests.support import accounts
from tuneplane.coordinator.demo.cluster import LocalCluster
from tuneplane.coordinator.store.logs import KEEP_BYTES


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("logs")
    pool = accounts.cluster_pool(1)
    with LocalCluster(
        root / "cluster", heartbeat_interval=0.5, heartbeat_timeout=3, member_pool=pool,
        member_root=accounts.traversable_root("job_logs"),
    ) as c:  # fmt: skip
        c.start_coordinator()
        c.add_agent("node-a", "h200:2")
        c.wait_connected()
        yield c


def _logs(cluster: LocalCluster, run_id: str, *args: str) -> subprocess.CompletedProcess[str]:
    done = cluster.tp("logs", run_id, *args)
    assert done.returncode == 0, done.stderr
    return done


def _wait_logs(cluster: LocalCluster, run_id: str, expected: str, *args: str) -> str:
    """Until `tp logs` prints exactly ``expected`` (shipping is asynchronous to the exit)."""
    deadline = time.monotonic() + 30
    while True:
        out = _logs(cluster, run_id, *args).stdout
        if out == expected or time.monotonic() > deadline:
            return out
        time.sleep(0.2)


def test_logs_of_a_finished_job(cluster: LocalCluster, tmp_path: Path) -> None:
    script = "for i in 1 2 3 4 5; do echo \"out $i\"; done\necho 'something broke' >&2\nexit 3\n"
    run_id = submit(cluster, project(cluster, tmp_path / "done", script))
    wait_state(cluster, run_id, "failed")
    expected = "".join(f"out {i}\n" for i in range(1, 6))
    assert _wait_logs(cluster, run_id, expected, "--stdout") == expected
    assert _logs(cluster, run_id, "--stderr").stdout == "something broke\n"
    # The Job failed: without --member and a stream, its failed member's stderr.
    assert _logs(cluster, run_id).stdout == "something broke\n"
    assert _logs(cluster, run_id, "--stdout", "--tail", "2").stdout == "out 4\nout 5\n"
    assert _logs(cluster, run_id, "--attempt", "1", "--member", "0").stdout == expected
    missing = cluster.tp("logs", run_id, "--member", "3")
    assert missing.returncode == 1 and "no member 3" in missing.stderr


def test_follow_sees_lines_as_they_are_printed_and_ends_at_exit(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    release = tmp_path / "release"
    script = f"echo first\nwhile [ ! -e {release} ]; do sleep 0.1; done\necho second\n"
    run_id = submit(cluster, project(cluster, tmp_path / "follow", script))
    wait_job(cluster, run_id, "the member to run", member_running)
    env = dict(os.environ, TUNEPLANE_CONTEXT=str(cluster.context_path))
    follower = subprocess.Popen(
        [sys.executable, "-m", "tuneplane.coordinator.cli.tp", "logs", run_id, "--follow",
         "--interval", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
    )  # fmt: skip
    try:
        assert follower.stdout is not None
        # The workload is still waiting for the release file: this line arrived live.
        assert follower.stdout.readline() == "first\n"
        assert follower.poll() is None
        release.touch()
        assert follower.stdout.readline() == "second\n"
        assert follower.wait(timeout=30) == 0
        assert follower.stdout.read() == ""
    finally:
        if follower.poll() is None:
            follower.kill()
        follower.wait()
    assert wait_state(cluster, run_id, "succeeded")["state"] == "succeeded"


def _restart_agent(cluster: LocalCluster) -> None:
    agent = cluster.agents[0]
    agent.process.popen.kill()
    agent.process.popen.wait()
    argv = [str(a) for a in agent.process.popen.args]  # type: ignore[union-attr]
    agent.process = cluster._spawn(agent.name, argv)
    cluster.wait_connected()


def test_logs_survive_an_agent_restart_without_duplicates(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    script = 'for i in $(seq 1 40); do echo "line $i"; sleep 0.1; done\n'
    run_id = submit(cluster, project(cluster, tmp_path / "restart", script))
    wait_job(cluster, run_id, "the member to run", member_running)
    deadline = time.monotonic() + 30
    while "line 5\n" not in _logs(cluster, run_id).stdout:
        assert time.monotonic() < deadline, "no log line arrived before the restart"
        time.sleep(0.1)
    _restart_agent(cluster)
    wait_state(cluster, run_id, "succeeded")
    expected = "".join(f"line {i}\n" for i in range(1, 41))
    assert _wait_logs(cluster, run_id, expected) == expected
    # The shipping offset lives in the Node's journal, readable with plain sqlite3.
    journal = cluster.agents[0].state_dir / "journal.db"
    with sqlite3.connect(f"file:{journal}?mode=ro", uri=True) as db:
        (value,) = db.execute(
            "SELECT value FROM meta WHERE key = ?", (f"logship:{run_id}.1.0:stdout",)
        ).fetchone()
    assert json.loads(value) == {"offset": len(expected), "done": True}


def test_a_chatty_workload_is_bounded(cluster: LocalCluster, tmp_path: Path) -> None:
    total = 8 * KEEP_BYTES
    script = f"head -c {total} /dev/zero | tr '\\0' 'x'\necho\necho END\n"
    run_id = submit(cluster, project(cluster, tmp_path / "chatty", script))
    wait_state(cluster, run_id, "succeeded")
    deadline = time.monotonic() + 30
    while True:
        out = _logs(cluster, run_id).stdout
        if out.endswith("END\n") or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert out.endswith("x\nEND\n"), out[-200:]
    marker, _, kept = out.partition("\n")
    dropped = int(marker.removeprefix("[... ").removesuffix(" bytes dropped ...]"))
    # What the file held is either kept or counted as dropped; at most 1 MiB is kept.
    assert dropped + len(kept) == total + len("\nEND\n")
    assert len(kept) <= KEEP_BYTES
    assert set(kept[: len(kept) - len("\nEND\n")]) == {"x"}
