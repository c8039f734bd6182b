"""Rotation load generator: one process playing many Nodes that renew their credentials.

Run by ``bench/rotation.py`` as ``python -m bench._rotation_load CONFIG.json``. Each Node opens a
real Connect stream, sends Hello and heartbeats at the interval Welcome gives. Protocol on stdio:
print ``ready <connected>`` once every stream has its Welcome, wait for a line on stdin, then
each Node sends CredentialRenewal at a uniformly random moment of the ``window_s`` window, waits
for CredentialIssued (its latency is what is measured) and answers CredentialStored, as the agent
does once the successor is on disk. Prints one JSON result.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import betterproto
from grpclib.client import Channel
from grpclib.const import Cardinality

from tuneplane.coordinator.tls import client_context
from tuneplane.proto import v1


async def _node(
    channel: Channel,
    node_id: str,
    credential: str,
    go: asyncio.Event,
    welcomed: asyncio.Queue[int],
    window_s: float,
    latencies: list[float],
    renewed: asyncio.Queue[str],
) -> None:
    async with channel.request(
        "/tuneplane.v1.Control/Connect",
        Cardinality.STREAM_STREAM,
        v1.NodeMessage,
        v1.CoordinatorMessage,
        metadata={"authorization": f"Bearer {credential}"},
    ) as stream:
        await stream.send_request()
        inventory = v1.Inventory(hostname=node_id, cpu_count=64, gpu_source="simulated")
        hello = v1.Hello(node_id=node_id, agent_version="bench", inventory=inventory)
        await stream.send_message(v1.NodeMessage(hello=hello))
        first = await stream.recv_message()
        assert first is not None and betterproto.which_one_of(first, "body")[0] == "welcome"
        interval = first.welcome.heartbeat_interval_ms / 1000
        await welcomed.put(1)

        async def beat() -> None:
            seq = 0
            while True:
                seq += 1
                await stream.send_message(v1.NodeMessage(heartbeat=v1.Heartbeat(seq=seq)))
                await asyncio.sleep(interval)

        async def renew() -> None:
            await go.wait()
            await asyncio.sleep(random.uniform(0, window_s))
            asked[0] = time.monotonic()
            await stream.send_message(
                v1.NodeMessage(credential_renewal=v1.CredentialRenewal(request_id=1))
            )

        asked = [0.0]
        tasks = [asyncio.create_task(beat()), asyncio.create_task(renew())]
        try:
            while True:
                message = await stream.recv_message()
                if message is None:
                    return
                kind, body = betterproto.which_one_of(message, "body")
                if kind == "credential_issued" and isinstance(body, v1.CredentialIssued):
                    latencies.append(time.monotonic() - asked[0])
                    await stream.send_message(
                        v1.NodeMessage(
                            credential_stored=v1.CredentialStored(request_id=body.request_id)
                        )
                    )
                    await renewed.put(body.node_credential)
        finally:
            for task in tasks:
                task.cancel()


async def run(config: dict[str, Any]) -> dict[str, Any]:
    host, _, port = config["control"].rpartition(":")
    ctx = client_context(Path(config["ca"]))
    channels = [Channel(host, int(port), ssl=ctx) for _ in range(config["channels"])]
    go = asyncio.Event()
    welcomed: asyncio.Queue[int] = asyncio.Queue()
    renewed: asyncio.Queue[str] = asyncio.Queue()
    latencies: list[float] = []
    nodes = config["nodes"]
    tasks = [
        asyncio.create_task(
            _node(
                channels[i % len(channels)],
                n["id"],
                n["credential"],
                go,
                welcomed,
                config["window_s"],
                latencies,
                renewed,
            )
        )
        for i, n in enumerate(nodes)
    ]
    for _ in nodes:
        await welcomed.get()
    print(f"ready {len(nodes)}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    started = time.monotonic()
    go.set()
    credentials = []
    deadline = config["window_s"] + config["grace_s"]
    try:
        for _ in nodes:
            credentials.append(await asyncio.wait_for(renewed.get(), deadline))
    except TimeoutError:
        pass
    elapsed = time.monotonic() - started
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for channel in channels:
        channel.close()
    return {
        "renewed": len(credentials),
        "elapsed_s": elapsed,
        "latencies_ms": [round(1000 * x, 3) for x in latencies],
    }


def main() -> int:
    config = json.loads(Path(sys.argv[1]).read_text())
    print(json.dumps(asyncio.run(run(config))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
