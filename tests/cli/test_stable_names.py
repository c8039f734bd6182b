"""``tp node ls`` shows each Node's display name next to its id: the host name it reports,
unique per Fleet (docs/operator.md). Two real agents enrolled with the same name report the same
host name, which is the case the suffix exists for."""

from __future__ import annotations

import json
from pathlib import Path

from tests.agent.jobs import wait_job
from tests.cli.tp_process import run_tp, run_tp_as
from tests.faults.jobs import project, submit
from tests.support.agent import start_agent
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tuneplane.coordinator.cli.render_fleet import display_names
from tuneplane.coordinator.fleetmodel import Node


def test_two_nodes_on_one_host_get_unique_names(tmp_path: Path) -> None:
    with start_coordinator(tmp_path) as coord:
        agents = [start_agent(tmp_path / d, coord, "gpu-a") for d in ("one", "two")]
        try:
            for agent in agents:
                agent.wait_connected()
            shown_names = _check_names(coord)
            _check_job_show(coord, tmp_path, shown_names)
        finally:
            for agent in agents:
                agent.stop()


def _check_names(coord: CoordinatorProcess) -> dict[str, str]:
    """The same host name twice: the later-enrolled Node is shown with ``-2``."""
    listed = run_tp_as(coord, None, "node", "ls", "--json")
    assert listed.returncode == 0, listed.stderr
    nodes = sorted(json.loads(listed.stdout), key=lambda n: (n["enrolled_at_ms"], n["id"]))
    assert len(nodes) == 2, nodes
    host = nodes[0]["hostname"]
    assert host == "gpu-a" and nodes[1]["hostname"] == host, nodes
    shown = run_tp_as(coord, None, "node", "ls")
    assert shown.returncode == 0, shown.stderr
    rows = {line.split()[0]: line.split() for line in shown.stdout.splitlines()[1:]}
    assert shown.stdout.splitlines()[0].split()[:2] == ["NODE", "NAME"], shown.stdout
    assert rows[nodes[0]["id"]][1] == host, shown.stdout
    assert rows[nodes[1]["id"]][1] == f"{host}-2", shown.stdout
    one = run_tp_as(coord, None, "node", "show", nodes[1]["id"])
    assert one.returncode == 0, one.stderr
    assert any(line.split() == ["Name", f"{host}-2"] for line in one.stdout.splitlines()), (
        one.stdout
    )
    return {node_id: row[1] for node_id, row in rows.items()}


def _check_job_show(coord: CoordinatorProcess, tmp_path: Path, names: dict[str, str]) -> None:
    """``tp job show`` names each member's Node next to its id."""
    root = project(coord, tmp_path / "proj", "custom/custom", {"train.sh": "true\n"})
    run_id = submit(coord, root, "h200:1")
    ended = wait_job(coord, run_id)
    assert ended["state"] == "succeeded", ended
    node_id = ended["attempts"][-1]["members"][0]["node_id"]
    shown = run_tp(
        "job", "show", run_id, cwd=root,
        env={"TUNEPLANE_CONTEXT": str(coord.context_path), "COLUMNS": "250"},
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert f"{node_id} ({names[node_id]})" in shown.stdout, shown.stdout


def _node(node_id: str, fleet: str, hostname: str, enrolled_at_ms: int) -> Node:
    return Node(
        id=node_id,
        fleet=fleet,
        hostname=hostname,
        scheduling="schedulable",
        scheduling_reason="",
        scheduling_changed_at_ms=0,
        scheduling_changed_by="",
        connected=True,
        disconnected_since_ms=0,
        last_heartbeat_ms=0,
        enrolled_at_ms=enrolled_at_ms,
        cpu_count=1,
        memory_bytes=0,
        gpu_source="",
        driver_version="",
        cuda_version="",
        gpus=(),
        members=(),
    )


def test_names_are_unique_per_fleet_in_enrollment_order() -> None:
    nodes = [
        _node("node-3", "a", "gpu", 30),
        _node("node-1", "a", "gpu", 10),
        _node("node-2", "b", "gpu", 20),
        _node("node-4", "a", "", 40),
        _node("node-5", "a", "gpu", 50),
    ]
    assert display_names(nodes) == {
        "node-1": "gpu",
        "node-2": "gpu",  # another Fleet: its own namespace
        "node-3": "gpu-2",
        "node-4": "node-4",  # no host name reported: the id
        "node-5": "gpu-3",
    }
