"""``tp node ls`` shows each Node's display name next to its id: the host name it reports,
unique per Fleet (docs/operator.md), chosen by the coordinator at enrollment and accepted by
commands in place of the id. Two real agents enrolled with the same name report the same host
name, which is the case the suffix exists for. The naming rule itself is tested on a real store
in tests/coordinator/test_node_names.py."""

from __future__ import annotations

import json
from pathlib import Path

from tests.agent.jobs import wait_job
from tests.cli.tp_process import run_tp, run_tp_as
from tests.faults.jobs import project, submit
from tests.support.agent import start_agent
from tests.support.coordinator import CoordinatorProcess, start_coordinator


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
    assert [n["name"] for n in nodes] == [host, f"{host}-2"], nodes
    shown = run_tp_as(coord, None, "node", "ls")
    assert shown.returncode == 0, shown.stderr
    rows = {line.split()[0]: line.split() for line in shown.stdout.splitlines()[1:]}
    assert shown.stdout.splitlines()[0].split()[:2] == ["NODE", "NAME"], shown.stdout
    assert rows[nodes[0]["id"]][1] == host, shown.stdout
    assert rows[nodes[1]["id"]][1] == f"{host}-2", shown.stdout
    # Commands take the name for the id.
    one = run_tp_as(coord, None, "node", "show", f"{host}-2")
    assert one.returncode == 0, one.stderr
    assert any(line.split() == ["Node", nodes[1]["id"]] for line in one.stdout.splitlines()), (
        one.stdout
    )
    assert any(line.split() == ["Name", f"{host}-2"] for line in one.stdout.splitlines()), (
        one.stdout
    )
    cordoned = run_tp_as(coord, None, "node", "cordon", f"{host}-2", "--reason", "by name")
    assert cordoned.returncode == 0, cordoned.stderr
    assert f"Node {nodes[1]['id']} is cordoned" in cordoned.stdout, cordoned.stdout
    back = run_tp_as(coord, None, "node", "uncordon", f"default/{host}-2")
    assert back.returncode == 0, back.stderr
    unknown = run_tp_as(coord, None, "node", "show", "no-such-host")
    assert unknown.returncode != 0
    assert "there is no Node 'no-such-host'" in unknown.stderr, unknown.stderr
    return {node_id: row[1] for node_id, row in rows.items()}


def _check_job_show(coord: CoordinatorProcess, tmp_path: Path, names: dict[str, str]) -> None:
    """``tp job show`` names each member's Node next to its id."""
    root = project(coord, tmp_path / "proj", "custom/custom", {"train.sh": "true\n"})
    run_id = submit(coord, root, "h200:1")
    ended = wait_job(coord, run_id)
    assert ended["state"] == "succeeded", ended
    member = ended["attempts"][-1]["members"][0]
    node_id = member["node_id"]
    assert member["node_name"] == names[node_id], member
    shown = run_tp(
        "job", "show", run_id, cwd=root,
        env={"TUNEPLANE_CONTEXT": str(coord.context_path), "COLUMNS": "250"},
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert f"{node_id} ({names[node_id]})" in shown.stdout, shown.stdout
