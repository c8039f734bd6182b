"""The reconnect-storm gate against a real coordinator over real gRPC: with every turn taken
(two Connects that never say Hello hold them), the next Connect waits its ``connect_wait_s``
and is refused as busy (UNAVAILABLE, a sentence) before anything of its Node is read or
recorded; once a turn is free a Node is welcomed again."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

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
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.store_backend import StoreBackend
from tuneplane.proto import v1

GATE = "\n[limits]\nconnects_at_once = 2\nconnect_wait_s = 1\n"


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


async def _hello_refused(channel: Channel, enrolled: v1.EnrollReply) -> GRPCError:
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
            await stream.recv_message()
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
