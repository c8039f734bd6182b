"""The version-skew policy at Connect, over real gRPC against a real coordinator: an agent newer
than the coordinator is refused with a sentence naming both versions and nothing of the Node
changes; an unversioned (0.1.x) agent is welcomed, and told who the coordinator is."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import trio
from grpclib import GRPCError
from grpclib.const import Status

from tests.coordinator.grpc_client import (
    connect_request,
    enrolled_node,
    node_stream,
    open_channel,
    simulated_inventory,
)
from tests.faults.jobs import node
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.store_backend import StoreBackend
from tuneplane.agent.adapter import open_aio_host
from tuneplane.agent.wire import Endpoint, Refused
from tuneplane.agent.wire_control import control_refusal
from tuneplane.proto import v1
from tuneplane.proto.contract import control_protocol as protocol


@pytest.fixture(scope="module")
def coord(
    tmp_path_factory: pytest.TempPathFactory, module_store_backend: StoreBackend
) -> Iterator[CoordinatorProcess]:
    with start_coordinator(tmp_path_factory.mktemp("skew")) as c:
        yield c


async def _refused(
    coord: CoordinatorProcess, enrolled: v1.EnrollReply, wire: int, hello: bool
) -> str:
    """Connect as an agent of protocol ``wire``: saying it in the request metadata only (the
    agent's probe, no Hello), or in a Hello only (no metadata). Our side ends the stream after
    what it sends, so the answer is the coordinator's status, never a bare reset."""
    metadata = {}
    if not hello:
        metadata = {protocol.PROTOCOL_HEADER: str(wire), protocol.VERSION_HEADER: "9.0.0"}
    channel = open_channel(coord.control, coord.ca_path)
    try:
        async with connect_request(channel, enrolled.node_credential, metadata) as stream:
            if hello:
                await stream.send_request()
                said = v1.Hello(
                    node_id=enrolled.node_id,
                    agent_version="9.0.0",
                    inventory=simulated_inventory("node-new", 2),
                    protocol=wire,
                    capabilities=["something-new"],
                )
                await stream.send_message(v1.NodeMessage(hello=said), end=True)
            else:
                await stream.send_request(end=True)
            with pytest.raises(GRPCError) as refused:
                await stream.recv_message()
    finally:
        channel.close()
    assert refused.value.status is Status.FAILED_PRECONDITION
    return str(refused.value.message)


@pytest.mark.parametrize("hello", [True, False], ids=["in-hello", "in-metadata"])
def test_an_agent_newer_than_the_coordinator_is_refused_and_nothing_changes(
    coord: CoordinatorProcess, hello: bool
) -> None:
    enrolled = enrolled_node(coord, "node-new")
    before = node(coord, enrolled.node_id)
    logged = len(coord.read_log())
    message = asyncio.run(_refused(coord, enrolled, protocol.PROTOCOL + 1, hello))
    assert f"agent 9.0.0 (control protocol {protocol.PROTOCOL + 1})" in message
    assert f"coordinator {protocol.release()} (control protocol {protocol.PROTOCOL})" in message
    assert "Upgrade the coordinators first" in message
    after = node(coord, enrolled.node_id)
    # Nothing of the Node was recorded: not connected, not seen, no inventory from this Hello.
    assert after == before
    log = coord.read_log()[logged:]
    assert f"node refused: outside the version-skew policy node={enrolled.node_id}" in log
    assert f"control stream opened node={enrolled.node_id}" not in log


def test_the_agents_probe_brings_back_the_version_refusal(
    coord: CoordinatorProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refusal that reached a session as a bare stream reset is asked for again by the agent
    (``control_refusal``): an agent newer than the coordinator gets the sentence there. The
    agent's side runs here with its protocol raised; the coordinator is a real process."""
    enrolled = enrolled_node(coord, "node-probe")
    monkeypatch.setattr(protocol, "PROTOCOL", protocol.PROTOCOL + 1)

    async def probe() -> Refused | None:
        async with open_aio_host():
            return await control_refusal(
                Endpoint.parse(coord.control), coord.ca_path, enrolled.node_credential
            )

    refusal = trio.run(probe)
    assert refusal is not None and refusal.status == "FAILED_PRECONDITION"
    assert "Upgrade the coordinators first" in str(refusal)
    monkeypatch.undo()
    # Within the policy the probe refuses nothing (and opens no session).
    assert trio.run(probe) is None


def test_an_unversioned_agent_is_welcomed_and_told_who_the_coordinator_is(
    coord: CoordinatorProcess,
) -> None:
    enrolled = enrolled_node(coord, "node-old")

    async def go() -> v1.Welcome:
        async with node_stream(
            coord.control, coord.ca_path, enrolled.node_credential, enrolled.node_id,
            hostname="node-old", agent_version="0.1.0",
        ) as node:  # fmt: skip
            assert node.welcome is not None
            return node.welcome

    welcome = asyncio.run(go())
    assert welcome.coordinator_version == protocol.release()
    assert welcome.protocol == protocol.PROTOCOL
    assert tuple(welcome.capabilities) == protocol.COORDINATOR_CAPABILITIES
    assert f"control stream opened node={enrolled.node_id} agent=0.1.0 protocol=1" in (
        coord.read_log()
    )
