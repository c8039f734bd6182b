"""What ``bench/takeover.py`` asks of the coordinators besides the Nodes' streams: Nodes enrolled
for real before anything is killed, and the admission it times from each kill (a custom Job in
the profile ``bench``, whose Fleet has no Nodes, so admitted Jobs wait and touch no Node).
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import threading
import time
from pathlib import Path

from grpclib.client import Channel

from tuneplane.agent.client_tls import grpc_client_context
from tuneplane.coordinator.auth import JOIN_PREFIX, hash_credential, new_credential
from tuneplane.coordinator.catalogue import Catalogue
from tuneplane.coordinator.cli.failover import pause_s
from tuneplane.coordinator.store.core import Store
from tuneplane.coordinator.store_location import parse_store_url
from tuneplane.proto import v1

#: How long an admission is asked for before the bench says what the last try said.
WAIT_S = 120.0


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


async def _admit(apis: list[str], ca: Path, token: str) -> str:
    """Preview + Commit as ``tp`` asks: each address in turn, a jittered pause after a round.
    "" once admitted; what the last try said when none succeeded within :data:`WAIT_S`."""
    rounds = 0
    said = ""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for address in apis:
            host, _, port = address.rpartition(":")
            channel = Channel(host, int(port), ssl=grpc_client_context(ca))
            stub = v1.ApiStub(channel, metadata={"authorization": f"Bearer {token}"}, timeout=10)
            try:
                preview = await stub.preview(v1.PreviewRequest(jobspec_json=jobspec(rounds)))
                key = f"rk-{time.monotonic_ns()}"
                await stub.commit(v1.CommitRequest(preview.preview_id, preview.digest, key))
            except Exception as exc:  # any failure: ask the next, as tp does when it may
                said = f"{address}: {type(exc).__name__}: {exc}"
            else:
                return ""
            finally:
                channel.close()
        rounds += 1
        await asyncio.sleep(pause_s(rounds, random.random()))
    return said


class Admission(threading.Thread):
    """The admission asked from the kill on, in a thread of its own: ``done_at`` (monotonic)
    when it succeeded, else NaN and ``said`` tells why."""

    def __init__(self, apis: list[str], ca: Path, token: str) -> None:
        super().__init__(daemon=True)
        self.asked = (apis, ca, token)
        self.done_at = float("nan")
        self.said = ""

    def run(self) -> None:
        self.said = asyncio.run(_admit(*self.asked))
        if not self.said:
            self.done_at = time.monotonic()
