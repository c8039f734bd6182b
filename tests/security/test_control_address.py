"""Who may tell the Nodes a new control address, and which addresses are refused. Each refusal
is checked with real processes together with "nothing changed": no address stored, no decision
recorded, and the Node's node.json untouched."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from grpclib import GRPCError
from grpclib.const import Status

from tests.coordinator.grpc_client import bearer, open_channel
from tests.support.agent import AgentProcess, start_agent
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tuneplane.proto import v1


def _set_as(coord: CoordinatorProcess, token: str, address: str) -> v1.SetControlAddressReply:
    async def call() -> v1.SetControlAddressReply:
        channel = open_channel(coord.api, coord.ca_path)
        try:
            stub = v1.ApiStub(channel, metadata=bearer(token), timeout=10)
            return await stub.set_control_address(v1.SetControlAddressRequest(address=address))
        finally:
            channel.close()

    return asyncio.run(call())


def _unchanged(coord: CoordinatorProcess, agent: AgentProcess, node_json: str) -> None:
    shown = coord.admin("control-address")
    assert shown.returncode == 0, shown.stderr
    assert "Nodes are told to dial: (nothing set" in shown.stdout
    assert coord.decisions("control address set") == []
    assert (agent.state_dir / "node.json").read_text() == node_json
    assert agent.cli("journal", "events", "--kind", "control-address-changed").stdout.strip() in (
        "",
        "(none)",
    )


@pytest.mark.slow
def test_only_an_admin_may_and_only_a_certified_name(tmp_path: Path) -> None:
    with start_coordinator(tmp_path) as coord:
        agent = start_agent(tmp_path, coord)
        try:
            agent.wait_connected()
            node_json = (agent.state_dir / "node.json").read_text()
            # A researcher's token: refused, whatever the address.
            bob = coord.create_user("bob")
            with pytest.raises(GRPCError) as denied:
                _set_as(coord, bob, "127.0.0.1:9")
            assert denied.value.status is Status.PERMISSION_DENIED
            assert "may not change the control address" in (denied.value.message or "")
            # An admin, but a host the server certificate does not cover: every Node would
            # refuse the coordinator there, so it is refused before anything is stored.
            with pytest.raises(GRPCError) as uncovered:
                _set_as(coord, coord.admin_token, "attacker.example:7444")
            assert uncovered.value.status is Status.INVALID_ARGUMENT
            assert "does not cover" in (uncovered.value.message or "")
            with pytest.raises(GRPCError) as malformed:
                _set_as(coord, coord.admin_token, "127.0.0.1")
            assert "is not HOST:PORT" in (malformed.value.message or "")
            # The same through the admin CLI, served and not.
            served = coord.admin("control-address", "attacker.example:7444")
            assert served.returncode == 1 and "does not cover" in served.stderr
            _unchanged(coord, agent, node_json)
            coord.stop()
            offline = coord.admin("control-address", "attacker.example:7444")
            assert offline.returncode == 1 and "does not cover" in offline.stderr
            both = coord.admin("control-address", "127.0.0.1:9", "--clear")
            assert both.returncode == 2 and "not both" in both.stderr
            _unchanged(coord, agent, node_json)
            assert json.loads(node_json)["coordinator"] == coord.control
        finally:
            agent.stop()
