"""The reconnect-storm gate against a real coordinator over real gRPC: with every turn taken
(two Connects that never say Hello hold them), the next Connect waits its ``connect_wait_s``
and is refused as busy (UNAVAILABLE, a sentence) before anything of its Node is read or
recorded; once a turn is free a Node is welcomed again. Once the coordinator has measured the
rate it welcomes Nodes at, a refusal names the Node's turn in its initial metadata, and a real
``tuneplane-node`` of a coordinator with no line dials again then, without asking the busy
coordinator why it said no. A Connect whose agent can wait in line is authenticated, told its
place at once, and welcomed on the same stream when a turn frees, however long past
``connect_wait_s``; a real ``tuneplane-node`` put in line is welcomed without dialing again."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
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
from tests.support import store_backend
from tests.support.agent import AgentProcess, start_agent, wait_until
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.prometheus import scrape
from tests.support.store_backend import StoreBackend
from tuneplane.agent.wire_control import connect_metadata
from tuneplane.coordinator.server.listeners import LISTEN_BACKLOG
from tuneplane.proto import v1
from tuneplane.proto.contract import control_protocol as protocol

GATE = "\n[limits]\nconnects_at_once = 2\nconnect_wait_s = 1\n[metrics]\nport = 0\n"
NO_LINE = GATE.replace("connect_wait_s = 1", "connect_wait_s = 1\nconnect_queue_s = 0")
DEFERRED = "tuneplane_coordinator_connects_deferred_total"
QUEUED = "tuneplane_coordinator_connects_queued_total"
WARM_WELCOMES = 20


def _counted(coord: CoordinatorProcess, counter: str) -> float:
    endpoints = json.loads((coord.state_dir / "endpoints.json").read_text())
    return scrape(str(endpoints["metrics"])).value(counter) or 0.0


def _deferred(coord: CoordinatorProcess) -> float:
    """Connects the coordinator refused as busy so far (its Prometheus counter)."""
    return _counted(coord, DEFERRED)


@pytest.fixture(scope="module")
def coord(
    tmp_path_factory: pytest.TempPathFactory, module_store_backend: StoreBackend
) -> Iterator[CoordinatorProcess]:
    # A long heartbeat timeout: a Connect that never says Hello keeps its turn for 30 s.
    with start_coordinator(tmp_path_factory.mktemp("gate"), heartbeat_timeout=30, config=GATE) as c:
        yield c


@pytest.fixture(scope="module")
def coord_no_line(
    tmp_path_factory: pytest.TempPathFactory, module_store_backend: StoreBackend
) -> Iterator[CoordinatorProcess]:
    # A coordinator of its own (its own database on PostgreSQL), with no line.
    with (
        store_backend.in_use(module_store_backend.sibling()),
        start_coordinator(tmp_path_factory.mktemp("no-line"), heartbeat_timeout=30, config=NO_LINE)
        as c,
    ):  # fmt: skip
        yield c


@contextlib.asynccontextmanager
async def _silent(channel: Channel, credential: str) -> AsyncIterator[None]:
    """A Connect that opens its stream and says nothing: it holds a turn."""
    async with connect_request(channel, credential) as stream:
        await stream.send_request()
        yield
        with contextlib.suppress(Exception):
            await stream.cancel()


@contextlib.asynccontextmanager
async def _every_turn_taken(
    coord: CoordinatorProcess, holders: list[v1.EnrollReply]
) -> AsyncIterator[Channel]:
    """Both turns (``connects_at_once = 2``) held by Connects of ``holders`` that never say
    Hello; yields a channel to the coordinator for the Connect under test."""
    channel = open_channel(coord.control, coord.ca_path)
    try:
        async with (
            _silent(channel, holders[0].node_credential),
            _silent(channel, holders[1].node_credential),
        ):
            await asyncio.sleep(0.2)  # both streams reach the coordinator first
            yield channel
    finally:
        channel.close()


async def _agent_behind_held_turns(
    coord: CoordinatorProcess,
    tmp_path: Path,
    name: str,
    started: list[AgentProcess],
    what: str,
    seen: Callable[[AgentProcess], bool],
) -> None:
    """Start a real ``tuneplane-node`` (appended to ``started``) while every turn is held by
    Nodes enrolled as ``<name>-hold-<i>``, and hold them until ``seen`` says ``what`` happened
    to it."""
    holders = await asyncio.to_thread(
        lambda: [enrolled_node(coord, f"{name}-hold-{i}") for i in range(2)]
    )
    async with _every_turn_taken(coord, holders):
        agent = start_agent(tmp_path, coord, name)
        started.append(agent)
        await asyncio.to_thread(wait_until, what, lambda: seen(agent))


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
        async with _every_turn_taken(coord, holders) as channel:
            return await _hello_refused(channel, late)

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
        async with _every_turn_taken(coord, holders) as channel:
            return await _hello_refused(channel, late, said)

    refused = asyncio.run(go())
    assert refused.status is Status.UNAVAILABLE
    come_back = protocol.come_back_in(said)
    assert come_back is not None and 0 < come_back <= 60, said
    assert said[protocol.BUSY_HEADER] == refused.message
    assert f"dials again in about {come_back:.1f} s, its turn" in str(refused.message)


def test_a_real_node_refused_as_busy_dials_again_at_its_turn(
    coord_no_line: CoordinatorProcess, tmp_path: Path
) -> None:
    coord = coord_no_line
    warm = enrolled_node(coord, "node-wait-warm")
    started: list[AgentProcess] = []
    deferred = _deferred(coord)

    async def go() -> None:
        await _rate_measured(coord, warm)
        await _agent_behind_held_turns(
            coord, tmp_path, "node-wait", started, "the Node to be refused as busy with a turn",
            lambda agent: "its turn" in agent.status().get("last_error", ""),
        )  # fmt: skip

    try:
        asyncio.run(go())
        (agent,) = started
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
        for agent in started:
            if agent.alive():
                agent.stop()


def _hello(enrolled: v1.EnrollReply) -> v1.NodeMessage:
    inventory = simulated_inventory(enrolled.node_id, 2)
    return v1.NodeMessage(
        hello=v1.Hello(node_id=enrolled.node_id, agent_version="test", inventory=inventory)
    )


def test_a_connect_that_can_wait_in_line_is_told_its_place_and_welcomed_when_a_turn_frees(
    coord: CoordinatorProcess,
) -> None:
    holders = [enrolled_node(coord, f"node-line-hold-{i}") for i in range(2)]
    late = enrolled_node(coord, "node-line-late")
    queued = _counted(coord, QUEUED)
    deferred = _deferred(coord)

    async def go() -> tuple[dict[str, str], float, v1.CoordinatorMessage | None]:
        # A channel of its own: the holders' goes when they hang up.
        channel = open_channel(coord.control, coord.ca_path)
        try:
            async with contextlib.AsyncExitStack() as holding:
                await holding.enter_async_context(_every_turn_taken(coord, holders))
                metadata = connect_metadata(late.node_credential)
                async with connect_request(channel, late.node_credential, metadata) as stream:
                    await stream.send_request()
                    await stream.send_message(_hello(late))
                    await asyncio.wait_for(stream.recv_initial_metadata(), 5)
                    said = dict(stream.initial_metadata or {})
                    first = asyncio.create_task(stream.recv_message())
                    # Still in line well past connect_wait_s (1 s), where others are refused.
                    done, _ = await asyncio.wait({first}, timeout=2.5)
                    assert not done
                    freed = time.monotonic()
                    await holding.aclose()  # the holders hang up: their turns are free
                    welcome = await asyncio.wait_for(first, 10)
                    after_s = time.monotonic() - freed
                    with contextlib.suppress(Exception):
                        await stream.cancel()
                    return said, after_s, welcome
        finally:
            channel.close()

    said, after_s, welcome = asyncio.run(go())
    wait_s = protocol.queued_for(said)
    assert wait_s is not None and 0 < wait_s <= protocol.QUEUED_CAP_S, said
    assert "this Node's turn is expected in about" in said[protocol.QUEUED_HEADER]
    assert welcome is not None and welcome.welcome.protocol == protocol.PROTOCOL
    assert after_s < 5
    assert _counted(coord, QUEUED) - queued == 1
    assert _deferred(coord) == deferred
    assert f"control stream opened node={late.node_id}" in coord.read_log()


def test_an_unknown_credential_asking_to_wait_in_line_is_refused_before_any_place(
    coord: CoordinatorProcess,
) -> None:
    holders = [enrolled_node(coord, f"node-line-bad-{i}") for i in range(2)]
    queued = _counted(coord, QUEUED)
    logged = len(coord.read_log())

    async def go() -> tuple[GRPCError, dict[str, str]]:
        async with _every_turn_taken(coord, holders) as channel:
            stolen = "tpn_" + "x" * 40
            async with connect_request(channel, stolen, connect_metadata(stolen)) as stream:
                await stream.send_request()
                await stream.send_message(_hello(holders[0]), end=True)
                with pytest.raises(GRPCError) as refused:
                    await asyncio.wait_for(stream.recv_message(), 10)
                return refused.value, dict(stream.initial_metadata or {})

    refused, said = asyncio.run(go())
    assert refused.status is Status.UNAUTHENTICATED
    assert "not enrolled with this coordinator" in str(refused.message)
    assert protocol.QUEUED_HEADER not in said
    assert _counted(coord, QUEUED) == queued
    assert "control stream opened" not in coord.read_log()[logged:]


def test_a_real_node_put_in_line_is_welcomed_without_dialing_again(
    coord: CoordinatorProcess, tmp_path: Path
) -> None:
    started: list[AgentProcess] = []
    deferred = _deferred(coord)
    try:
        asyncio.run(
            _agent_behind_held_turns(
                coord, tmp_path, "node-line-real", started, "the Node to be put in line",
                lambda agent: "waiting in line for a Welcome" in agent.read_log(),
            )
        )  # fmt: skip
        (agent,) = started
        agent.wait_connected()
        # status.json says connected before the agent logs it: wait for the line itself.
        wait_until(
            "the agent to log its connection", lambda: "connected coordinator=" in agent.read_log()
        )
        log = agent.read_log()
        waited = log.index("waiting in line for a Welcome")
        assert "reconnecting" not in log[waited:], log[waited:]
        assert "connected coordinator=" in log[waited:]
        assert _deferred(coord) == deferred
    finally:
        for agent in started:
            if agent.alive():
                agent.stop()


def test_every_listener_queues_a_whole_fleet_dialing_at_once(coord: CoordinatorProcess) -> None:
    """After a restart every Node dials within a second on a connection of its own: each
    listener's backlog (ss's Send-Q) is LISTEN_BACKLOG, or the kernel's cap, not grpclib's 100."""
    ss = shutil.which("ss")
    assert ss is not None, "this test reads listeners' backlogs with ss (iproute2)"
    cap = int(Path("/proc/sys/net/core/somaxconn").read_text())
    for address in (coord.control, coord.api, coord.telemetry):
        port = address.rpartition(":")[2]
        shown = subprocess.run(
            [ss, "-Hltn", f"sport = :{port}"], capture_output=True, text=True, check=True
        ).stdout.split()
        assert shown[0] == "LISTEN", shown
        assert int(shown[2]) == min(LISTEN_BACKLOG, cap), (address, shown)
