"""The reconnect-storm gate against a real coordinator over real gRPC: with every turn taken
(two Connects that never say Hello hold them), the next Connect waits its ``connect_wait_s``
and is refused as busy (UNAVAILABLE, a sentence) before anything of its Node is read or
recorded; once a turn is free a Node is welcomed again. Once the coordinator has measured the
rate it welcomes Nodes at, a refusal names the Node's turn in its initial metadata, and a real
``tuneplane-node`` dials again then, without asking the busy coordinator why it said no."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from grpclib import GRPCError
from grpclib.client import Channel
from grpclib.const import Status

from tests.coordinator.grpc_client import (
    connect_request,
    enrolled_node,
    node_stream,
    open_channel,
    simulated_inventory,
)
from tests.faults.jobs import node
from tests.support.agent import AgentProcess, start_agent, wait_until
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.prometheus import scrape
from tests.support.store_backend import StoreBackend
from tuneplane.proto import v1
from tuneplane.proto.contract import control_protocol as protocol

GATE = "\n[limits]\nconnects_at_once = 2\nconnect_wait_s = 1\n[metrics]\nport = 0\n"
DEFERRED = "tuneplane_coordinator_connects_deferred_total"
WARM_WELCOMES = 20


def _deferred(coord: CoordinatorProcess) -> float:
    """Connects the coordinator refused as busy so far (its Prometheus counter)."""
    endpoints = json.loads((coord.state_dir / "endpoints.json").read_text())
    return scrape(str(endpoints["metrics"])).value(DEFERRED) or 0.0


@pytest.fixture(scope="module")
def coord(
    tmp_path_factory: pytest.TempPathFactory, module_store_backend: StoreBackend
) -> Iterator[CoordinatorProcess]:
    # A long heartbeat timeout: a Connect that never says Hello keeps its turn for 30 s.
    with start_coordinator(tmp_path_factory.mktemp("gate"), heartbeat_timeout=30, config=GATE) as c:
        yield c


@contextlib.asynccontextmanager
async def _silent(channel: Channel, credential: str) -> AsyncIterator[None]:
    """A Connect that opens its stream and says nothing: it holds a turn."""
    async with connect_request(channel, credential) as stream:
        await stream.send_request()
        yield
        with contextlib.suppress(Exception):
            await stream.cancel()


async def _hello_refused(
    channel: Channel, enrolled: v1.EnrollReply, said: dict[str, str] | None = None
) -> GRPCError:
    async with connect_request(channel, enrolled.node_credential) as stream:
        await stream.send_request()
        hello = v1.Hello(
            node_id=enrolled.node_id,
            agent_version="test",
            inventory=simulated_inventory("node-late", 2),
        )
        # Our side ends after the Hello: the answer is the status, never a bare reset.
        await stream.send_message(v1.NodeMessage(hello=hello), end=True)
        with pytest.raises(GRPCError) as refused:
            assert await stream.recv_message() is None
            await stream.recv_trailing_metadata()
        if said is not None:
            said.update(stream.initial_metadata or {})
    return refused.value


def test_a_connect_past_every_turn_waits_then_is_refused_as_busy_and_nothing_changes(
    coord: CoordinatorProcess,
) -> None:
    holders = [enrolled_node(coord, f"node-hold-{i}") for i in range(2)]
    late = enrolled_node(coord, "node-late")
    before = node(coord, late.node_id)
    logged = len(coord.read_log())

    async def go() -> GRPCError:
        channel = open_channel(coord.control, coord.ca_path)
        try:
            async with (
                _silent(channel, holders[0].node_credential),
                _silent(channel, holders[1].node_credential),
            ):
                await asyncio.sleep(0.2)  # both streams reach the coordinator first
                return await _hello_refused(channel, late)
        finally:
            channel.close()

    refused = asyncio.run(go())
    assert refused.status is Status.UNAVAILABLE
    assert "the coordinator is welcoming 2 Nodes" in str(refused.message)
    assert "dials again after its backoff" in str(refused.message)
    assert node(coord, late.node_id) == before
    log = coord.read_log()[logged:]
    assert "connects deferred: busy welcoming in_flight=2" in log
    assert f"control stream opened node={late.node_id}" not in log

    async def welcomed() -> v1.Welcome:
        async with node_stream(
            coord.control, coord.ca_path, late.node_credential, late.node_id,
            hostname="node-late",
        ) as node:  # fmt: skip
            assert node.welcome is not None
            return node.welcome

    # The holders hung up: their turns are free again.
    assert asyncio.run(welcomed()).protocol >= 2


async def _welcome(coord: CoordinatorProcess, enrolled: v1.EnrollReply) -> None:
    async with node_stream(
        coord.control, coord.ca_path, enrolled.node_credential, enrolled.node_id,
        hostname=enrolled.node_id,
    ) as node:  # fmt: skip
        assert node.welcome is not None


async def _rate_measured(coord: CoordinatorProcess, enrolled: v1.EnrollReply) -> None:
    """Welcomes one after another: the gate measures the rate it welcomes Nodes at."""
    for _ in range(WARM_WELCOMES):
        await _welcome(coord, enrolled)


def test_a_busy_refusal_names_the_nodes_turn_once_a_rate_is_measured(
    coord: CoordinatorProcess,
) -> None:
    holders = [enrolled_node(coord, f"node-turn-hold-{i}") for i in range(2)]
    late = enrolled_node(coord, "node-turn-late")
    said: dict[str, str] = {}

    async def go() -> GRPCError:
        await _rate_measured(coord, late)
        channel = open_channel(coord.control, coord.ca_path)
        try:
            async with (
                _silent(channel, holders[0].node_credential),
                _silent(channel, holders[1].node_credential),
            ):
                await asyncio.sleep(0.2)
                return await _hello_refused(channel, late, said)
        finally:
            channel.close()

    refused = asyncio.run(go())
    assert refused.status is Status.UNAVAILABLE
    come_back = protocol.come_back_in(said)
    assert come_back is not None and 0 < come_back <= 60, said
    assert said[protocol.BUSY_HEADER] == refused.message
    assert f"dials again in about {come_back:.1f} s, its turn" in str(refused.message)


def test_a_real_node_refused_as_busy_dials_again_at_its_turn(
    coord: CoordinatorProcess, tmp_path: Path
) -> None:
    holders = [enrolled_node(coord, f"node-wait-hold-{i}") for i in range(2)]
    warm = enrolled_node(coord, "node-wait-warm")
    agent: AgentProcess | None = None
    deferred = _deferred(coord)

    async def go() -> None:
        nonlocal agent
        await _rate_measured(coord, warm)
        channel = open_channel(coord.control, coord.ca_path)
        try:
            async with (
                _silent(channel, holders[0].node_credential),
                _silent(channel, holders[1].node_credential),
            ):
                agent = start_agent(tmp_path, coord, "node-wait")
                await asyncio.to_thread(
                    wait_until,
                    "the Node to be refused as busy with a turn",
                    lambda: "its turn" in agent.status().get("last_error", ""),
                )
        finally:
            channel.close()

    try:
        asyncio.run(go())
        assert agent is not None
        agent.wait_connected()
        log = agent.read_log()
        turns = [float(t) for t in re.findall(r"dials again in about ([0-9.]+) s, its turn", log)]
        waits = [float(w) for w in re.findall(r"reconnecting .* in_s=([0-9.]+)", log)]
        assert turns and len(waits) == len(turns), (turns, waits)
        for turn, wait in zip(turns, waits, strict=True):
            # Each refusal: it waited for the turn named, give or take a tenth and rounding.
            assert turn * 0.9 - 0.06 <= wait <= turn * 1.1 + 0.06, (turns, waits)
        # Refused once per turn, and it opened no second Connect to ask the busy coordinator
        # why it said no (that one would have waited and been refused too).
        assert _deferred(coord) - deferred == len(turns)
    finally:
        if agent is not None and agent.alive():
            agent.stop()
