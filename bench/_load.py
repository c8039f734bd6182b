"""Heartbeat load generator: one process playing many Nodes on real Connect streams.

Run by ``bench/coordinator.py`` as ``python -m bench._load CONFIG.json``. The config names the
control address, the CA, the Nodes' ids and credentials, and how many grpclib channels to spread
the streams over. Protocol on stdio: print ``ready <connected>`` once every stream has its
Welcome, wait for a line on stdin, count HeartbeatAcks for ``window_s``, print one JSON result.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import betterproto
from grpclib.client import Channel
from grpclib.const import Cardinality

from tuneplane.coordinator.tls import client_context
from tuneplane.proto import v1


class Counter:
    def __init__(self) -> None:
        self.acks = 0
        self.counting = False
        self.latencies: list[float] = []


async def _node(
    channel: Channel,
    node_id: str,
    credential: str,
    counter: Counter,
    welcomed: asyncio.Queue[int],
    stop: asyncio.Event,
) -> None:
    async with channel.request(
        "/tuneplane.v1.Control/Connect",
        Cardinality.STREAM_STREAM,
        v1.NodeMessage,
        v1.CoordinatorMessage,
        metadata={"authorization": f"Bearer {credential}"},
    ) as stream:
        await stream.send_request()
        inventory = v1.Inventory(
            hostname=node_id,
            cpu_count=64,
            memory_bytes=1 << 40,
            gpu_source="simulated",
            gpus=[
                v1.Gpu(index=i, uuid=f"GPU-{node_id}-{i}", series="h200", healthy=True)
                for i in range(8)
            ],
        )
        await stream.send_message(
            v1.NodeMessage(
                hello=v1.Hello(node_id=node_id, agent_version="bench", inventory=inventory)
            )
        )
        first = await stream.recv_message()
        assert first is not None and betterproto.which_one_of(first, "body")[0] == "welcome"
        interval = first.welcome.heartbeat_interval_ms / 1000
        await welcomed.put(1)
        sent: dict[int, float] = {}

        async def beat() -> None:
            seq = 0
            while not stop.is_set():
                seq += 1
                sent[seq] = time.monotonic()
                await stream.send_message(v1.NodeMessage(heartbeat=v1.Heartbeat(seq=seq)))
                await asyncio.sleep(interval)

        beater = asyncio.create_task(beat())
        try:
            while not stop.is_set():
                message = await stream.recv_message()
                if message is None:
                    return
                kind, body = betterproto.which_one_of(message, "body")
                if kind == "heartbeat_ack" and counter.counting and body is not None:
                    counter.acks += 1
                    at = sent.pop(body.seq, None)
                    if at is not None:
                        counter.latencies.append(time.monotonic() - at)
        finally:
            beater.cancel()


async def run(config: dict[str, Any]) -> dict[str, Any]:
    host, _, port = config["control"].rpartition(":")
    ctx = client_context(Path(config["ca"]))
    channels = [Channel(host, int(port), ssl=ctx) for _ in range(config["channels"])]
    counter = Counter()
    welcomed: asyncio.Queue[int] = asyncio.Queue()
    stop = asyncio.Event()
    nodes = config["nodes"]
    tasks = [
        asyncio.create_task(
            _node(channels[i % len(channels)], n["id"], n["credential"], counter, welcomed, stop)
        )
        for i, n in enumerate(nodes)
    ]
    for _ in nodes:
        await welcomed.get()
    print(f"ready {len(nodes)}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    counter.counting = True
    started = time.monotonic()
    await asyncio.sleep(config["window_s"])
    counter.counting = False
    elapsed = time.monotonic() - started
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for channel in channels:
        channel.close()
    return {
        "acks": counter.acks,
        "elapsed_s": elapsed,
        # Every ack's latency, so the parent computes percentiles over all loaders together.
        "latencies_ms": [round(1000 * x, 3) for x in counter.latencies],
    }


def main() -> int:
    config = json.loads(Path(sys.argv[1]).read_text())
    print(json.dumps(asyncio.run(run(config))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
