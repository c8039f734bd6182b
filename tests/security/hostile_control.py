"""A stand-in control gateway that skips every check, run as its own process by test_bad_input.

Usage: ``python -m tests.security.hostile_control MODE HOST PORT STATE_DIR OUT_JSON``. It serves
TLS with the real coordinator's certificate (so a real agent connects to it), answers Hello with
Welcome and acks heartbeats and reports. ``prepare`` then sends three Prepare orders no real
coordinator would send (a NUL in an experiment file name, in a capsule file name, in the run
id); ``uuids`` sends Prepares whose GPU UUIDs do not match the Node's card at the index (a
wrong UUID, a UUID count that differs), then one that matches; ``flood`` sends bytes that are
no message, then a 40 MiB message, one connection each.
Once it has seen what it waits for and three more heartbeats, it writes what it saw to OUT_JSON
and exits.
A process of its own: asyncio servers and the agent's trio-asyncio cannot share a test process.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import betterproto
from grpclib.const import Cardinality, Handler
from grpclib.exceptions import StreamTerminatedError
from grpclib.server import Server

from tests.coordinator.grpc_client import jobspec
from tests.security.raw_calls import RawCodec
from tuneplane.coordinator.server.tls import TlsPaths, server_context
from tuneplane.proto import v1

RUN_FOR_S = 90.0


def prepare(
    run_id: str,
    source_files: dict[str, str],
    capsule: dict[str, bytes],
    gpu_uuids: tuple[str, ...] = (),
) -> Any:
    spec = jobspec(gpus=1, profile="h200")
    spec["source_files"] = source_files
    spec["runtime_id"] = "host:bash"  # what admission resolves custom/custom to
    digests = {k: "sha256:" + hashlib.sha256(v).hexdigest() for k, v in capsule.items()}
    return v1.CoordinatorMessage(
        prepare=v1.Prepare(
            member=v1.MemberRef(run_id=run_id, attempt=1, member_index=0),
            jobspec_json=json.dumps(spec),
            member_count=1,
            gpu_indexes=[0],
            capsule_files=capsule,
            capsule_digests=digests,
            gpu_uuids=list(gpu_uuids),
        )
    )


ORDERS = [
    prepare("run-nul-source", {"a\x00b.sh": "AA=="}, {}),
    prepare("run-nul-capsule", {}, {"cap\x00sule.json": b"{}"}),
    prepare("run-\x00", {}, {}),
]

# The agent under test simulates one GPU ("h200:1") on the Node named node-a.
SIMULATED_UUID = "GPU-sim-node-a-0"
UUID_ORDERS = [
    prepare("run-wrong-uuid", {}, {}, ("GPU-not-this-card",)),
    prepare("run-two-uuids", {}, {}, (SIMULATED_UUID, SIMULATED_UUID)),
    prepare(
        "run-right-uuid",
        {},
        {
            "capsule.json": json.dumps(
                {"launcher": "member", "entrypoint": ["bash", "-c", "true"]}
            ).encode()
        },
        (SIMULATED_UUID,),
    ),
]

OVERSIZED_BYTES = 40 * 1024 * 1024

# Per connection, in order, for ``flood``: what follows Welcome. The agent must drop the session
# for the first two and stay connected on the third.
FLOOD = [
    [bytes([0x0A, 0x05, 0x61, 0x62]), b"\x08"],  # a Welcome of bad bytes, then a cut varint
    [bytes(v1.CoordinatorMessage(abort=v1.Abort(reason="x" * OVERSIZED_BYTES)))],
    [],
]


class HostileControl:
    """Serves Connect with a raw codec, so it can send any bytes at all."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.connections = 0
        self.replies: list[dict[str, Any]] = []
        self.heartbeats_after = 0
        self.done = asyncio.Event()

    def __mapping__(self) -> dict[str, Handler]:
        return {
            "/tuneplane.v1.Control/Connect": Handler(
                self._connect, Cardinality.STREAM_STREAM, bytes, bytes
            )
        }

    def _orders(self) -> list[bytes]:
        if self.mode in ("prepare", "uuids"):
            orders = ORDERS if self.mode == "prepare" else UUID_ORDERS
            return [bytes(o) for o in orders] if self.connections == 1 else []
        return FLOOD[min(self.connections, len(FLOOD)) - 1]

    def _settled(self) -> bool:
        if self.mode == "prepare":
            return len(self.replies) >= 2
        if self.mode == "uuids":
            return len(self.replies) >= len(UUID_ORDERS)
        return self.connections >= len(FLOOD)

    async def _connect(self, stream: Any) -> None:
        self.connections += 1
        await stream.recv_message()  # Hello
        now = int(time.time() * 1000)
        welcome = v1.Welcome(
            heartbeat_interval_ms=500,
            heartbeat_timeout_ms=10_000,
            server_time_ms=now,
            credential_issued_at_ms=now,
            credential_expires_at_ms=now + 86_400_000,
        )
        await stream.send_message(bytes(v1.CoordinatorMessage(welcome=welcome)))
        with contextlib.suppress(StreamTerminatedError):
            for order in self._orders():
                await stream.send_message(order)
            async for data in stream:
                message = v1.NodeMessage().parse(data)
                _, body = betterproto.which_one_of(message, "body")
                if isinstance(body, v1.Heartbeat):
                    if self._settled():
                        self.heartbeats_after += 1
                        if self.heartbeats_after >= 3:
                            self.done.set()
                    ack = v1.HeartbeatAck(seq=body.seq)
                    await stream.send_message(bytes(v1.CoordinatorMessage(heartbeat_ack=ack)))
                elif isinstance(body, v1.MemberReport):
                    done = v1.ReportAck(report_seq=body.report_seq)
                    await stream.send_message(bytes(v1.CoordinatorMessage(report_ack=done)))
                elif isinstance(body, v1.PrepareReply):
                    self.replies.append(
                        {"run_id": body.member.run_id, "ok": body.ok, "reason": body.reason}
                    )


async def serve(mode: str, host: str, port: int, state_dir: Path) -> dict[str, Any]:
    control = HostileControl(mode)
    server = Server([control], codec=RawCodec())
    await server.start(host, port, ssl=server_context(TlsPaths.under(state_dir)))
    try:
        await asyncio.wait_for(control.done.wait(), RUN_FOR_S)
    except TimeoutError:
        pass
    finally:
        server.close()
        await server.wait_closed()
    return {
        "replies": control.replies,
        "heartbeats_after": control.heartbeats_after,
        "connections": control.connections,
    }


if __name__ == "__main__":
    seen = asyncio.run(serve(sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])))
    Path(sys.argv[5]).write_text(json.dumps(seen))
