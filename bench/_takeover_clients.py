"""What ``bench/takeover.py`` needs before it kills anything: Nodes enrolled for real, and the
JobSpec of a bench admission (a custom Job in the profile ``bench``, whose Fleet has no Nodes, so
admitted Jobs wait and never touch the simulated Nodes).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from pathlib import Path

from grpclib.client import Channel

from tuneplane.agent.client_tls import grpc_client_context
from tuneplane.coordinator.auth import JOIN_PREFIX, hash_credential, new_credential
from tuneplane.coordinator.catalogue import Catalogue
from tuneplane.coordinator.store.core import Store
from tuneplane.coordinator.store_location import parse_store_url
from tuneplane.proto import v1


async def enroll(url: str, control: str, ca: Path, count: int) -> list[dict[str, str]]:
    """``count`` Nodes: join tokens written to the store (as ``token create`` writes them), each
    redeemed by a real Enroll at ``control``; their ids and control credentials."""
    tokens = [new_credential(JOIN_PREFIX) for _ in range(count)]
    store = await Store.open(parse_store_url(url, "bench"))
    try:
        now = int(time.time() * 1000)
        for token in tokens:
            await store.create_join_token(hash_credential(token), "default", now, now + 3_600_000)
    finally:
        await store.close()
    host, _, port = control.rpartition(":")
    channel = Channel(host, int(port), ssl=grpc_client_context(ca))
    stub = v1.ControlStub(channel, timeout=120)
    gate = asyncio.Semaphore(32)

    async def one(i: int, token: str) -> dict[str, str]:
        async with gate:
            reply = await stub.enroll(
                v1.EnrollRequest(
                    join_token=token, hostname=f"bench-{i:05d}", inventory=v1.Inventory()
                )
            )
            return {"id": reply.node_id, "credential": reply.node_credential}

    try:
        return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(tokens))))
    finally:
        channel.close()


def jobspec(i: int) -> str:
    """A custom Job's JobSpec in the profile ``bench``; ``i`` names its experiment."""
    recipe = Catalogue.bundled().get("custom/custom")
    assert recipe is not None
    return json.dumps(
        {
            "api_version": "tuneplane/v1",
            "project": "bench",
            "experiment": f"takeover{i}",
            "method_id": "custom/custom",
            "recipe_digest": recipe.digest,
            "runtime_id": "",
            "entrypoint": ["bash", "train.sh"],
            "resources": {"profile": "bench", "series": "", "gpus": 1},
            "parameters": {},
            "env": {},
            "source_files": {"train.sh": base64.b64encode(b"echo hi\n").decode()},
        }
    )
