"""Cancel, failure of one member, and retry, through real processes on loopback TLS.

One coordinator and two agents (two simulated h200 each) run as separate processes; `tp` runs as
a child process. Workloads are real shell scripts whose processes get real signals.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.lifecycle_support import (
    member_running,
    project,
    show,
    submit,
    wait_job,
    wait_state,
)
from tests.support import accounts
from tuneplane.coordinator.demo.cluster import COORDINATOR, TP, LocalCluster

SIGKILL = 9
SIGTERM = 15


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("lifecycle")
    pool = accounts.cluster_pool(2)
    with LocalCluster(
        root / "cluster", heartbeat_interval=0.5, heartbeat_timeout=3, member_pool=pool,
        member_root=accounts.traversable_root("job_lifecycle"),
    ) as c:  # fmt: skip
        c.start_coordinator()
        c.add_agent("node-a", "h200:2")
        c.add_agent("node-b", "h200:2")
        c.wait_connected()
        yield c


def _cancel(cluster: LocalCluster, run_id: str, *extra: str) -> dict[str, object]:
    done = cluster.tp("job", "cancel", run_id, *extra, "--json")
    assert done.returncode == 0, done.stderr
    reply: dict[str, object] = json.loads(done.stdout)
    return reply


def test_cancel_a_running_job_that_ignores_sigterm(cluster: LocalCluster, tmp_path: Path) -> None:
    # SIG_IGN is inherited across exec: the shell and every sleep it starts ignore SIGTERM.
    script = "trap '' TERM\necho started\nwhile true; do sleep 0.2; done\n"
    root = project(cluster, tmp_path / "stubborn", script, grace_period_s=2)
    run_id = submit(cluster, root)
    wait_job(cluster, run_id, "the member to run", member_running)

    asked = time.monotonic()
    first = _cancel(cluster, run_id, "--reason", "wrong learning rate")
    assert first["outcome"] == "cancelling"
    again = _cancel(cluster, run_id)
    assert again["outcome"] in ("already_cancelling", "already_cancelled")

    job = wait_state(cluster, run_id, "cancelled", "failed", "succeeded")
    waited = time.monotonic() - asked
    assert job["state"] == "cancelled", job
    assert job["attempts"][0]["state"] == "cancelled"
    (member,) = job["attempts"][0]["members"]
    # The grace period passed and then SIGKILL ended what ignored SIGTERM.
    assert member["has_exit"] and member["signal"] == SIGKILL, member
    assert waited >= 2, waited
    states = [c["state"] for c in job["history"]]
    assert states[-2:] == ["cancelling", "cancelled"], states
    assert "wrong learning rate" in job["history"][-1]["reason"]

    third = cluster.tp("job", "cancel", run_id)
    assert third.returncode == 0, third.stderr
    assert "already cancelled" in third.stdout
    # Its GPUs are free again: the Fleet counts none in use for this Job.
    nodes = json.loads(cluster.tp("node", "ls", "--json").stdout)
    assert all(not n["members"] for n in nodes), nodes


def test_cancel_a_queued_job_needs_no_node(cluster: LocalCluster, tmp_path: Path) -> None:
    for agent in cluster.agents:
        done = cluster.tp("node", "cordon", agent.node_id, "--reason", "cancel test")
        assert done.returncode == 0, done.stderr
    try:
        root = project(cluster, tmp_path / "queued", "echo never\n")
        run_id = submit(cluster, root)
        assert show(cluster, run_id)["state"] == "queued"
        # Only the owner (or an admin) may cancel it.
        made = subprocess.run(
            [*COORDINATOR, "user", "create", "bob", "--state-dir", str(cluster.coordinator_dir)],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        token = tmp_path / "bob.token"
        token.write_text(made.stdout.strip() + "\n")
        env = dict(os.environ, TUNEPLANE_CONTEXT=str(cluster.context_path))
        refused = subprocess.run(
            [*TP, "--token-file", str(token), "job", "cancel", run_id],
            capture_output=True, text=True, env=env, timeout=60, check=False,
        )  # fmt: skip
        assert refused.returncode == 1 and "belongs to admin" in refused.stderr, refused
        assert show(cluster, run_id)["state"] == "queued"
        done = cluster.tp("job", "cancel", run_id)
        assert done.returncode == 0, done.stderr
        assert "Cancelled Job" in done.stdout
        job = show(cluster, run_id)
        assert job["state"] == "cancelled" and job["attempts"] == [], job
    finally:
        for agent in cluster.agents:
            cluster.tp("node", "uncordon", agent.node_id)
    # Nothing ever places it, even with the Nodes open again: a Job submitted after it is
    # placed and ends (so the scheduler has run with the Nodes open), and it is still cancelled.
    later = submit(cluster, project(cluster, tmp_path / "later", "echo placed\n"))
    assert wait_state(cluster, later, "succeeded", "failed")["state"] == "succeeded"
    assert show(cluster, run_id)["state"] == "cancelled"


def test_a_failed_member_stops_its_sibling_and_a_retry_succeeds(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    script = (
        'if [ "$TUNEPLANE_ATTEMPT" = 2 ]; then echo "attempt 2 of $TUNEPLANE_MEMBER_INDEX"; '
        "exit 0; fi\n"
        'if [ "$TUNEPLANE_MEMBER_INDEX" = 1 ]; then sleep 1; exit 4; fi\n'
        "sleep 600\n"
    )
    root = project(cluster, tmp_path / "pair", script, grace_period_s=2)
    run_id = submit(cluster, root, "--members", "2", profile="h200:2")

    job = wait_job(
        cluster,
        run_id,
        "both members to end",
        lambda j: (
            j["state"] == "failed"
            and all(m["state"] == "exited" for m in j["attempts"][0]["members"])
        ),
    )
    assert job["state_reason"] == "member 1 exited with code 4", job
    first, second = job["attempts"][0]["members"]
    assert second["exit_code"] == 4
    # Member 0 would have slept ten minutes: the coordinator stopped it (SIGTERM ends sleep).
    assert first["has_exit"] and first["signal"] == SIGTERM, first
    assert any("member 1 failed" in c["reason"] for c in first["history"]), first["history"]

    refused = cluster.tp("job", "retry", "run-does-not-exist")
    assert refused.returncode == 1 and "no Job" in refused.stderr

    done = cluster.tp("job", "retry", run_id, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["attempt"] == 2
    job = wait_state(cluster, run_id, "succeeded", "failed", "cancelled", "aborted")
    assert job["state"] == "succeeded", job
    assert [a["number"] for a in job["attempts"]] == [1, 2]
    assert all(m["exit_code"] == 0 for m in job["attempts"][1]["members"])
    states = [c["state"] for c in job["history"]]
    assert states.count("queued") == 2 and states[-1] == "succeeded", states

    shown = cluster.tp("job", "show", run_id)
    assert "Attempt 1" in shown.stdout and "Attempt 2" in shown.stdout, shown.stdout

    again = cluster.tp("job", "retry", run_id)
    assert again.returncode == 1
    assert "succeeded" in again.stderr and "Submit the experiment again" in again.stderr


def test_a_disconnected_node_gets_the_cancel_when_it_reconnects(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    root = project(cluster, tmp_path / "away", "sleep 600\n", grace_period_s=2)
    run_id = submit(cluster, root)
    job = wait_job(cluster, run_id, "the member to run", member_running)
    node_id = job["attempts"][0]["members"][0]["node_id"]
    (agent,) = [a for a in cluster.agents if a.node_id == node_id]
    # A stopped agent leaves its members running; the coordinator sees the member unknown.
    assert agent.process.stop() == 0
    wait_state(cluster, run_id, "unknown")
    assert _cancel(cluster, run_id)["outcome"] == "cancelling"
    assert show(cluster, run_id)["state"] == "cancelling"
    argv = [str(a) for a in agent.process.popen.args]  # type: ignore[union-attr]
    agent.process = cluster._spawn(agent.name, argv)
    job = wait_state(cluster, run_id, "cancelled", "failed", "succeeded")
    assert job["state"] == "cancelled", job
    (member,) = job["attempts"][0]["members"]
    assert member["has_exit"] and member["signal"] == SIGTERM, member
