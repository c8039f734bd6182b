"""Rotation load generator: one process playing many Nodes that renew their credentials.

Run by ``bench/rotation.py`` as ``python -m bench._rotation_load CONFIG.json``; the Nodes are
played by the load driver of ``bench/_load.py`` (real Connect streams, Hello, heartbeats at the
interval Welcome gives, ``ready``/"go" on stdio). On "go" each Node sends CredentialRenewal at a
uniformly random moment of the ``window_s`` window, waits for CredentialIssued (its latency is
what is measured) and answers CredentialStored, as the agent does once the successor is on disk.
Prints one JSON result.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import betterproto

from bench._load import NodeStream, Speak, drive, heartbeats, main_with
from tuneplane.proto import v1


def _inventory(node_id: str) -> v1.Inventory:
    return v1.Inventory(hostname=node_id, cpu_count=64, gpu_source="simulated")


async def run(config: dict[str, Any]) -> dict[str, Any]:
    go = asyncio.Event()
    renewed: asyncio.Queue[str] = asyncio.Queue()
    latencies: list[float] = []
    window_s = config["window_s"]

    def speak(node_id: str) -> Speak:
        async def renewing(stream: NodeStream, interval: float) -> None:
            asked = 0.0

            async def renew() -> None:
                nonlocal asked
                await go.wait()
                await asyncio.sleep(random.uniform(0, window_s))
                asked = time.monotonic()
                await stream.send_message(
                    v1.NodeMessage(credential_renewal=v1.CredentialRenewal(request_id=1))
                )

            tasks = [
                asyncio.create_task(heartbeats(stream, interval)),
                asyncio.create_task(renew()),
            ]
            try:
                async for message in stream:
                    kind, body = betterproto.which_one_of(message, "body")
                    if kind == "credential_issued" and isinstance(body, v1.CredentialIssued):
                        latencies.append(time.monotonic() - asked)
                        stored = v1.CredentialStored(request_id=body.request_id)
                        await stream.send_message(v1.NodeMessage(credential_stored=stored))
                        await renewed.put(body.node_credential)
            finally:
                for task in tasks:
                    task.cancel()

        return renewing

    async def measure() -> dict[str, Any]:
        started = time.monotonic()
        go.set()
        credentials = []
        deadline = window_s + config["grace_s"]
        try:
            for _ in config["nodes"]:
                credentials.append(await asyncio.wait_for(renewed.get(), deadline))
        except TimeoutError:
            pass
        return {
            "renewed": len(credentials),
            "elapsed_s": time.monotonic() - started,
            "latencies_ms": [round(1000 * x, 3) for x in latencies],
        }

    return await drive(config, _inventory, speak, measure)


if __name__ == "__main__":
    raise SystemExit(main_with(run))
