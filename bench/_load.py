"""Load driver: one process playing many Nodes on real Connect streams.

Run by ``bench/coordinator.py`` as ``python -m bench._load CONFIG.json`` to count heartbeat acks;
:func:`drive` is also what ``bench/_rotation_load.py`` plays its renewing Nodes with. The config
names the control address, the CA, the Nodes' ids and credentials, and how many grpclib channels
to spread the streams over. Protocol on stdio: print ``ready <connected>`` once every stream has
its Welcome, wait for a line on stdin, measure (here: count HeartbeatAcks for ``window_s``),
print one JSON result.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import betterproto
from grpclib.client import Channel, Stream
from grpclib.const import Cardinality
from multidict import MultiDict

from tuneplane.agent.client_tls import grpc_client_context
from tuneplane.agent.wire_control import connect_metadata
from tuneplane.coordinator.server import gc_settings
from tuneplane.proto import v1
from tuneplane.proto.contract.control_protocol import BUSY_HEADER, come_back_in

_T = TypeVar("_T")

NodeStream = Stream[v1.NodeMessage, v1.CoordinatorMessage]
# What a Node does once welcomed: given its stream and the heartbeat interval Welcome gave.
Speak = Callable[[NodeStream, float], Awaitable[None]]


def open_connect(channel: Channel, credential: str) -> Any:
    """A Connect stream opened as tuneplane-node opens it: its release, protocol and
    capabilities in the metadata (it can wait in line)."""
    return channel.request(
        "/tuneplane.v1.Control/Connect",
        Cardinality.STREAM_STREAM,
        v1.NodeMessage,
        v1.CoordinatorMessage,
        metadata=connect_metadata(credential),
    )


async def send_hello(stream: Stream[Any, Any], node_id: str, inventory: v1.Inventory) -> None:
    hello = v1.Hello(node_id=node_id, agent_version="bench", inventory=inventory)
    await stream.send_message(v1.NodeMessage(hello=hello))


async def coordinator_answer(
    stream: Stream[Any, Any], timeout_s: float | None = None
) -> dict[str, str]:
    """The coordinator's first answer to Hello, before any Welcome: its initial metadata
    (busy, or put in line), string values only."""
    await asyncio.wait_for(stream.recv_initial_metadata(), timeout_s)
    return {k: v for k, v in (stream.initial_metadata or MultiDict()).items() if isinstance(v, str)}


def gpu_inventory(node_id: str) -> v1.Inventory:
    """An eight-GPU H200 host, as the heartbeat load reports itself."""
    return v1.Inventory(
        hostname=node_id,
        cpu_count=64,
        memory_bytes=1 << 40,
        gpu_source="simulated",
        gpus=[
            v1.Gpu(index=i, uuid=f"GPU-{node_id}-{i}", series="h200", healthy=True)
            for i in range(8)
        ],
    )


async def heartbeats(
    stream: NodeStream, interval: float, sent: dict[int, float] | None = None
) -> None:
    """Send a Heartbeat every ``interval`` seconds, noting in ``sent`` when each one left."""
    seq = 0
    while True:
        seq += 1
        if sent is not None:
            sent[seq] = time.monotonic()
        await stream.send_message(v1.NodeMessage(heartbeat=v1.Heartbeat(seq=seq)))
        await asyncio.sleep(interval)


async def drive(
    config: dict[str, Any],
    inventory: Callable[[str], v1.Inventory],
    speak: Callable[[str], Speak],
    measure: Callable[[], Awaitable[dict[str, Any]]],
) -> dict[str, Any]:
    """Connect every Node of ``config``, say ready, wait for "go", and return ``measure()``.

    Each Node opens its Connect stream, sends Hello with ``inventory(node_id)``, and once welcomed
    runs ``speak(node_id)`` on the stream until the measurement is over.
    """
    host, _, port = config["control"].rpartition(":")
    ctx = grpc_client_context(Path(config["ca"]))
    channels = [Channel(host, int(port), ssl=ctx) for _ in range(config["channels"])]
    welcomed: asyncio.Queue[int] = asyncio.Queue()

    async def node(channel: Channel, node_id: str, credential: str) -> None:
        # As tuneplane-node does: say it can wait in line, and when a busy coordinator refuses
        # the Connect anyway, dial again at the turn it named (else after a second or so).
        while True:
            async with open_connect(channel, credential) as stream:
                await stream.send_request()
                await send_hello(stream, node_id, inventory(node_id))
                said = await coordinator_answer(stream)
                if BUSY_HEADER not in said:
                    first = await stream.recv_message()
                    assert first is not None
                    assert betterproto.which_one_of(first, "body")[0] == "welcome"
                    await welcomed.put(1)
                    await speak(node_id)(stream, first.welcome.heartbeat_interval_ms / 1000)
                    return
                # Refused as busy: reset the stream, as the agent does. Left as it is, grpclib
                # would wait for its trailers and raise the refusal (or that this side never
                # ended its stream) as the block is left.
                await stream.cancel()
            await asyncio.sleep(come_back_in(said) or 1 + random.random())

    nodes = config["nodes"]
    tasks = [
        asyncio.create_task(node(channels[i % len(channels)], n["id"], n["credential"]))
        for i, n in enumerate(nodes)
    ]
    try:
        await _all_welcomed(welcomed, len(nodes), tasks)
        print(f"ready {len(nodes)}", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        return await measure()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for channel in channels:
            channel.close()


async def _all_welcomed(
    welcomed: asyncio.Queue[int], count: int, nodes: list[asyncio.Task[None]]
) -> None:
    """Wait for ``count`` Welcomes; a Node task that ends first fails the load at once (its
    exception, or a sentence), so the bench is not left waiting for a Node that gave up."""

    async def count_all() -> None:
        for _ in range(count):
            await welcomed.get()

    counting = asyncio.create_task(count_all())
    try:
        done, _ = await asyncio.wait([counting, *nodes], return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task is not counting:
                task.result()
                raise RuntimeError("a Node ended its Connect loop before every Node was welcomed")
    finally:
        counting.cancel()


def load_process(run: Callable[[dict[str, Any]], Coroutine[Any, Any, _T]]) -> _T:
    """Every load process's start: the coordinator's collector thresholds, then ``run`` with
    the config named on the command line."""
    # Thousands of streams in one process: the coordinator's collector thresholds, or full
    # collections of this process's heap stop it for a second or more, and what it measures
    # meanwhile (acks, Welcomes) would count that pause as the coordinator's.
    gc_settings.apply()
    config = json.loads(Path(sys.argv[1]).read_text())
    return asyncio.run(run(config))


def main_with(run: Callable[[dict[str, Any]], Coroutine[Any, Any, dict[str, Any]]]) -> int:
    """Run a load process and print its JSON result."""
    print(json.dumps(load_process(run)), flush=True)
    return 0


async def run(config: dict[str, Any]) -> dict[str, Any]:
    acks = 0
    counting = False
    latencies: list[float] = []

    def speak(node_id: str) -> Speak:
        async def acked(stream: NodeStream, interval: float) -> None:
            nonlocal acks
            sent: dict[int, float] = {}
            beater = asyncio.create_task(heartbeats(stream, interval, sent))
            try:
                async for message in stream:
                    kind, body = betterproto.which_one_of(message, "body")
                    if kind == "heartbeat_ack" and counting and isinstance(body, v1.HeartbeatAck):
                        acks += 1
                        at = sent.pop(body.seq, None)
                        if at is not None:
                            latencies.append(time.monotonic() - at)
            finally:
                beater.cancel()

        return acked

    async def measure() -> dict[str, Any]:
        nonlocal counting
        counting = True
        started = time.monotonic()
        await asyncio.sleep(config["window_s"])
        counting = False
        return {
            "acks": acks,
            "elapsed_s": time.monotonic() - started,
            # Every ack's latency, so the parent computes percentiles over all loaders together.
            "latencies_ms": [round(1000 * x, 3) for x in latencies],
        }

    return await drive(config, gpu_inventory, speak, measure)


if __name__ == "__main__":
    raise SystemExit(main_with(run))
