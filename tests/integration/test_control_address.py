"""Moving the coordinator (docs/operator.md): `tuneplane-coordinator control-address` tells the
Nodes a new control address; they store it, keep the old one as a fallback, and follow the
coordinator to it. Real coordinator and agent processes over loopback TLS."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

from tests.support.agent import AgentProcess, start_agent
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.processes import wait_until


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _node_json(agent: AgentProcess) -> dict[str, object]:
    data: dict[str, object] = json.loads((agent.state_dir / "node.json").read_text())
    return data


def _dialed(coord: CoordinatorProcess, node_id: str) -> str:
    shown = coord.admin("control-address")
    assert shown.returncode == 0, shown.stderr
    row = next(line for line in shown.stdout.splitlines() if line.startswith(node_id))
    return row.split()[-1]


def _changes(agent: AgentProcess) -> list[dict[str, Any]]:
    out = agent.cli("journal", "events", "--kind", "control-address-changed", "--json")
    assert out.returncode == 0, out.stderr
    rows: list[dict[str, Any]] = json.loads(out.stdout)
    return rows


@pytest.mark.slow
def test_nodes_follow_the_coordinator_to_a_new_port_and_fall_back(tmp_path: Path) -> None:
    with start_coordinator(tmp_path) as coord:
        agent = start_agent(tmp_path, coord)
        try:
            agent.wait_connected()
            api, old_control, telemetry = coord.ports()
            old = f"127.0.0.1:{old_control}"
            assert _dialed(coord, agent.node_id) == old
            new = f"127.0.0.1:{_free_port()}"

            # Told while connected: the Node stores it at once and keeps the old as a fallback.
            told = coord.admin("control-address", new)
            assert told.returncode == 0, told.stderr
            assert f"Nodes are told to dial {new}: 1 connected Node(s) told now" in told.stdout
            wait_until("node.json to name the new address",
                       lambda: _node_json(agent)["coordinator"] == new)  # fmt: skip
            assert _node_json(agent)["previous_coordinators"] == [old]
            (change,) = _changes(agent)
            assert (change["details"]["old"], change["details"]["new"]) == (old, new), change
            assert coord.decisions("control address set")[-1]["detail"]["address"] == new

            # The coordinator moves: the Node dials the new address first and gets there.
            coord.stop()
            coord.start(ports=(api, int(new.rsplit(":", 1)[1]), telemetry))
            agent.wait_connected()
            wait_until("the Node to dial the new address",
                       lambda: _dialed(coord, agent.node_id) == new)  # fmt: skip

            # A wrong address (nothing listens there) strands nobody: the fallback is dialed.
            wrong = f"127.0.0.1:{_free_port()}"
            assert coord.admin("control-address", wrong).returncode == 0
            wait_until("node.json to name the wrong address",
                       lambda: _node_json(agent)["coordinator"] == wrong)  # fmt: skip
            assert _node_json(agent)["previous_coordinators"] == [new, old]
            coord.stop()
            # The stored address is cleared while the coordinator is down (store written directly).
            cleared = coord.admin("control-address", "--clear")
            assert cleared.returncode == 0, cleared.stderr
            coord.start(ports=(api, int(new.rsplit(":", 1)[1]), telemetry))
            agent.wait_connected(timeout=60)
            wait_until("the Node to come back through its fallback",
                       lambda: _dialed(coord, agent.node_id) == new)  # fmt: skip
            assert "Nodes are told to dial: (nothing set" in coord.admin("control-address").stdout
            assert "Traceback" not in agent.read_log()
        finally:
            agent.stop()
