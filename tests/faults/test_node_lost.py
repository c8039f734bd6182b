"""A Node that never comes back, with real processes: kill -9 an agent whose members run, declare
its Node lost (by the admin CLI, or by a Fleet's max_disconnect), then bring the agent back on the
same state directory and watch it stop the members its runners kept alive.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agent.jobs import job, journal, tp
from tests.faults.jobs import held_gpus, node, pending_reports, project, runner_alive, submit
from tests.support.agent import AgentProcess, start_agent, wait_until
from tests.support.coordinator import CoordinatorProcess, start_coordinator

pytestmark = pytest.mark.slow

REASON = "powered off through its BMC; ipmitool says chassis power off"
DECLARATION = f"declared lost by admin: {REASON}"


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[CoordinatorProcess]:
    with start_coordinator(tmp_path) as coord:
        yield coord


def _held(release: Path) -> dict[str, str]:
    """A custom experiment whose workload runs until ``release`` exists (or it is stopped)."""
    return {
        "train.sh": (
            'echo started >> "$TUNEPLANE_OUT_DIR/starts"\n'
            f'while [ ! -e "{release}" ]; do sleep 0.1; done\n'
        )
    }


def _running(coord: CoordinatorProcess, run_id: str) -> dict[str, Any]:
    shown: dict[str, Any] = wait_until(
        f"job {run_id} to be running",
        lambda: (j := job(coord, run_id))["state"] == "running" and j,
        60,
    )
    return shown


def _member_dirs(agent: AgentProcess) -> dict[str, Path]:
    members = journal(agent, "members", "--json")
    return {m["member"].rsplit(".", 2)[0]: Path(m["member_dir"]) for m in members}


def _history(coord: CoordinatorProcess, run_id: str) -> list[str]:
    return [h["state"] for h in job(coord, run_id)["history"]]


def test_node_lost_ends_the_jobs_and_a_returning_agent_stops_what_its_runners_kept(
    coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    agent = start_agent(tmp_path, coordinator)
    agent.wait_connected()
    release = tmp_path / "release"
    root = project(coordinator, tmp_path / "proj", "custom/custom", _held(release))
    failing = submit(coordinator, root, "h200:1")
    cancelled = submit(coordinator, root, "h200:1")
    for run_id in (failing, cancelled):
        _running(coordinator, run_id)
    dirs = _member_dirs(agent)
    try:
        # A connected Node is refused with a sentence, and nothing changes.
        refused = coordinator.admin("node", "lost", agent.node_id, "--reason", REASON)
        assert refused.returncode == 1, refused.stdout
        assert f"Node {agent.node_id} is connected" in refused.stderr
        assert not coordinator.decisions("node declared lost")
        assert job(coordinator, failing)["state"] == "running"

        agent.kill()  # SIGKILL: the machine "dies"; its runners keep the members alive here
        for run_id in (failing, cancelled):
            wait_until(
                f"{run_id} to be unknown",
                lambda r=run_id: job(coordinator, r)["state"] == "unknown",
            )
        assert all(runner_alive(d) for d in dirs.values())
        # A cancel of a Job on a disconnected Node waits for the Node...
        tp(coordinator, "job", "cancel", cancelled, "--reason", "not needed")
        assert job(coordinator, cancelled)["state"] == "cancelling"

        out = coordinator.admin("node", "lost", agent.node_id, "--reason", REASON)
        assert out.returncode == 0, out.stderr
        assert f"Declared Node {agent.node_id} lost; it is cordoned." in out.stdout
        assert f"Job {failing} is failed: member 0 was {DECLARATION}" in out.stdout

        # ...and completes once the Node is declared lost.
        shown = job(coordinator, cancelled)
        assert shown["state"] == "cancelled", shown
        shown = job(coordinator, failing)
        assert shown["state"] == "failed" and shown["state_reason"] == f"member 0 was {DECLARATION}"
        assert shown["attempts"][0]["members"][0]["state"] == "lost"
        viewed = node(coordinator, agent.node_id)
        assert viewed["scheduling"] == "cordoned" and not viewed["connected"]
        assert not [g for g in viewed["gpus"] if g["held_by"]]
        (declared,) = coordinator.decisions("node declared lost", agent.node_id)
        assert declared["detail"]["by"] == "admin" and declared["detail"]["reason"] == REASON
        assert len(coordinator.decisions("member declared lost")) == 2
        assert len(coordinator.decisions("node cordoned", agent.node_id)) == 1
        assert {d["run_id"] for d in coordinator.decisions("release")} >= {failing, cancelled}

        # Declaring it again, by its name this time, changes nothing.
        again = coordinator.admin("node", "lost", viewed["name"], "--reason", REASON)
        assert again.returncode == 0 and "holds no live member: no Job changed" in again.stdout
        assert f"Node {agent.node_id} holds" in again.stdout
        assert len(coordinator.decisions("node declared lost")) == 1
        histories = {r: _history(coordinator, r) for r in (failing, cancelled)}

        # The machine comes back after all (the runners survived): the agent re-attaches, is
        # told its members were declared lost, stops them, and journals why.
        agent.restart()
        agent.wait_connected()
        for run_id, member_dir in dirs.items():
            wait_until(f"the member of {run_id} to be stopped", lambda d=member_dir: not (
                runner_alive(d)
            ))  # fmt: skip
        wait_until(
            "both members exited in the journal",
            lambda: (
                [m["state"] for m in journal(agent, "members", "--json")] == ["exited", "exited"]
            ),
        )
        events = journal(agent, "events", "--json")
        stops = [e for e in events if e["kind"] == "cancel-received"]
        assert {e["member"].rsplit(".", 2)[0] for e in stops} == {failing, cancelled}
        assert all(
            e["reason"] == DECLARATION and e["details"].get("declared_lost") for e in stops
        ), stops
        assert "member declared lost by the coordinator; stopping it" in agent.read_log()
        # Its late reports were refused with the declaration and changed no Job.
        wait_until("every report answered", lambda: not pending_reports(agent))
        refusals = [e for e in events + journal(agent, "events", "--json") if (
            e["kind"] == "report-refused"
        )]  # fmt: skip
        assert refusals and all(DECLARATION in e["reason"] for e in refusals)
        assert coordinator.decisions("report refused", agent.node_id)
        assert {r: _history(coordinator, r) for r in (failing, cancelled)} == histories
        assert not held_gpus(agent)
        assert not (release.exists())
    finally:
        release.write_text("go")
        agent.stop()


def test_max_disconnect_declares_a_silent_node_lost_by_itself(tmp_path: Path) -> None:
    config = '\n[fleet.default]\nmax_disconnect = "2s"\n'
    with start_coordinator(tmp_path, config=config) as coordinator:
        agent = start_agent(tmp_path, coordinator)
        agent.wait_connected()
        release = tmp_path / "release"
        root = project(coordinator, tmp_path / "proj", "custom/custom", _held(release))
        run_id = submit(coordinator, root, "h200:1")
        _running(coordinator, run_id)
        (member_dir,) = _member_dirs(agent).values()
        try:
            agent.kill()
            shown = wait_until(
                "max_disconnect to end the Job",
                lambda: (j := job(coordinator, run_id))["state"] == "failed" and j,
                30,
            )
            assert shown["state_reason"] == (
                "member 0 was declared lost by coordinator (max_disconnect): it was disconnected "
                "for longer than the Fleet default's max_disconnect (2s)"
            )
            assert "unknown" in _history(coordinator, run_id)
            (declared,) = coordinator.decisions("node declared lost", agent.node_id)
            assert declared["detail"]["by"] == "coordinator (max_disconnect)"
            assert node(coordinator, agent.node_id)["scheduling"] == "cordoned"
            agent.restart()
            agent.wait_connected()
            wait_until("the member to be stopped", lambda: not runner_alive(member_dir))
            # It stays lost: the returning Node's reports are refused.
            wait_until("every report answered", lambda: not pending_reports(agent))
            assert job(coordinator, run_id)["state"] == "failed"
        finally:
            release.write_text("go")
            agent.stop()


def _credentials_ended(coord: CoordinatorProcess, run_id: str) -> list[bool]:
    """Whether each collector credential of ``run_id`` has started its drain window."""
    db = sqlite3.connect(f"file:{coord.state_dir / 'telemetry.db'}?mode=ro", uri=True)
    try:
        rows = db.execute(
            "SELECT ended_at_ms FROM collector_credentials WHERE run_id = ?", (run_id,)
        ).fetchall()
    finally:
        db.close()
    return [r[0] is not None for r in rows]


def test_node_lost_with_no_coordinator_serving_is_kept_and_enforced(
    coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    agent = start_agent(tmp_path, coordinator)
    agent.wait_connected()
    release = tmp_path / "release"
    root = project(coordinator, tmp_path / "proj", "custom/custom", _held(release))
    run_id = submit(coordinator, root, "h200:1")
    _running(coordinator, run_id)
    (member_dir,) = _member_dirs(agent).values()
    name = node(coordinator, agent.node_id)["name"]
    try:
        agent.kill()
        coordinator.stop()
        # With no coordinator serving, the store is written directly; the name still works.
        out = coordinator.admin("node", "lost", f"default/{name}", "--reason", REASON)
        assert out.returncode == 0, out.stderr
        assert f"Declared Node {agent.node_id} lost" in out.stdout
        assert f"Job {run_id} is failed: member 0 was declared lost by admin CLI: {REASON}" in (
            out.stdout
        )
        assert _credentials_ended(coordinator, run_id) == [True]
        coordinator.restart()
        assert job(coordinator, run_id)["state"] == "failed"
        assert node(coordinator, agent.node_id)["scheduling"] == "cordoned"
        agent.restart()
        agent.wait_connected()
        wait_until("the member to be stopped", lambda: not runner_alive(member_dir))
        wait_until("every report answered", lambda: not pending_reports(agent))
        assert job(coordinator, run_id)["state"] == "failed"
    finally:
        release.write_text("go")
        agent.stop()


def test_node_lost_stops_the_members_on_other_nodes_that_worked_with_it(
    coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    # One GPU per Node, two asked for: one member on each Node.
    a = start_agent(tmp_path, coordinator, name="gpu-a", simulate_gpus="h200:1")
    b = start_agent(tmp_path, coordinator, name="gpu-b", simulate_gpus="h200:1")
    a.wait_connected()
    b.wait_connected()
    release = tmp_path / "release"
    root = project(coordinator, tmp_path / "proj", "custom/custom", _held(release))
    run_id = submit(coordinator, root, "h200:2")
    shown = _running(coordinator, run_id)
    nodes = {m["index"]: m["node_id"] for m in shown["attempts"][0]["members"]}
    lost, kept = (b, a) if nodes[1] == b.node_id else (a, b)
    (kept_dir,) = _member_dirs(kept).values()
    try:
        lost.kill()
        wait_until("the Job to be unknown", lambda: job(coordinator, run_id)["state"] == "unknown")
        out = coordinator.admin("node", "lost", lost.node_id, "--reason", REASON)
        assert out.returncode == 0, out.stderr
        done = job(coordinator, run_id)
        assert done["state"] == "failed" and DECLARATION in done["state_reason"]
        # The member on the Node that stayed is stopped, and its GPU comes back.
        wait_until("the other member to be stopped", lambda: not runner_alive(kept_dir))
        (member,) = journal(kept, "members", "--json")
        wait_until("its exit", lambda: journal(kept, "members", "--json")[0]["state"] == "exited")
        stop = [e for e in journal(kept, "events", "--json") if e["kind"] == "cancel-received"]
        assert (
            stop
            and DECLARATION in stop[0]["reason"]
            and "stopping the others" in (stop[0]["reason"])
        )
        assert not stop[0]["details"].get("declared_lost")
        wait_until("no GPU held on either Node", lambda: not [
            g for n in (a, b) for g in node(coordinator, n.node_id)["gpus"] if g["held_by"]
        ])  # fmt: skip
        assert node(coordinator, kept.node_id)["scheduling"] == "schedulable"
        assert job(coordinator, run_id)["state"] == "failed"
        assert member["member"].startswith(run_id)
    finally:
        release.write_text("go")
        a.stop()
        b.stop()
