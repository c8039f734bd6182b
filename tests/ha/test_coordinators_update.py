"""A coordinator joins while Nodes are connected: the leader tells each Node whose agent
announced ``coordinators-update`` at once (a Coordinators message on the open stream), and sends
an unversioned (0.1.x) agent nothing it does not understand: that one learns the list at its
next Welcome."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import anyio
import pytest

from tests.coordinator.grpc_client import enroll, node_stream
from tests.support.agent import start_agent
from tests.support.coordinator import start_coordinator
from tests.support.ha import start_standby
from tuneplane.proto.contract import control_protocol as protocol

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.mark.usefixtures("pg_backend")
def test_a_joining_coordinator_is_pushed_to_nodes_that_take_it_and_no_others(
    tmp_path: Path,
) -> None:
    leader = start_coordinator(tmp_path / "a", heartbeat_timeout=30)
    standby = None
    agent = start_agent(tmp_path, leader)
    try:
        agent.wait_connected()
        node_json = agent.state_dir / "node.json"
        assert json.loads(node_json.read_text())["coordinators"] == []
        reconnects = agent.status()["reconnects"]
        assert agent.status()["coordinator_protocol"] == protocol.PROTOCOL
        token = leader.create_join_token()
        old = asyncio.run(enroll(leader.control, leader.ca_path, token, "node-old", 2))

        async def go() -> list[str]:
            async with node_stream(
                leader.control, leader.ca_path, old.node_credential, old.node_id,
                hostname="node-old", agent_version="0.1.0",
            ) as unversioned:  # fmt: skip
                nonlocal standby
                standby = await anyio.to_thread.run_sync(start_standby, leader, tmp_path / "b")
                deadline = time.monotonic() + 30
                while len(json.loads(node_json.read_text())["coordinators"]) != 2:
                    assert time.monotonic() < deadline, "the agent was not told the standby"
                    await anyio.sleep(0.05)
                # Told on the stream it had: no reconnect.
                assert agent.status()["reconnects"] == reconnects
                # The unversioned stream hears nothing but heartbeat acks meanwhile (its
                # heartbeat timeout is 30 s: the coordinator has no reason to close it).
                with pytest.raises(TimeoutError):
                    kind, body = await unversioned.recv(timeout=2)
                    raise AssertionError(f"an unversioned agent was sent {kind}: {body}")
                return list(json.loads(node_json.read_text())["coordinators"])

        listed = asyncio.run(go())
        assert listed[0] == leader.control and len(set(listed)) == 2
        assert "coordinators shared" in leader.read_log()
        assert "nodes_told=1" in leader.read_log()
    finally:
        agent.stop()
        if standby is not None:
            standby.stop()
        leader.stop()
