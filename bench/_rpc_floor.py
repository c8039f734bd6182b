"""The ceiling our RPC stack puts on admissions: Preview + Commit with handlers that do nothing.

A child process serves ``Api/Preview`` and ``Api/Commit`` with grpclib over TLS (the
coordinator's own certificate and server context, the same message types), each handler only
receiving its request and sending an empty reply; the bench's client makes the same pairs of
calls the admissions figure makes. What is left between that rate and our admissions is the
coordinator's own work (authorization, the JobSpec's checks, the store's fsynced writes, the
scheduling pass); what is left between it and Slurm's sbatch is the cost of two gRPC calls in
Python on this machine.

``python -m bench._rpc_floor STATE_DIR PORT_FILE`` is the server (its port written to the file).
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from grpclib.client import Channel
from grpclib.const import Cardinality, Handler
from grpclib.server import Server

from tuneplane.agent.client_tls import grpc_client_context
from tuneplane.coordinator.server.tls import TlsPaths, server_context
from tuneplane.proto import v1

READY_TIMEOUT_S = 60.0


class _DoNothing:
    """Preview and Commit that read their request and answer an empty reply."""

    def __mapping__(self) -> dict[str, Handler]:
        async def preview(stream: Any) -> None:
            await stream.recv_message()
            await stream.send_message(v1.PreviewReply())

        async def commit(stream: Any) -> None:
            await stream.recv_message()
            await stream.send_message(v1.Receipt())

        return {
            "/tuneplane.v1.Api/Preview": Handler(
                preview, Cardinality.UNARY_UNARY, v1.PreviewRequest, v1.PreviewReply
            ),
            "/tuneplane.v1.Api/Commit": Handler(
                commit, Cardinality.UNARY_UNARY, v1.CommitRequest, v1.Receipt
            ),
        }


async def _serve(state_dir: Path, port_file: Path) -> None:
    # A socket bound here, so the port is known before serving (grpclib names none back); with
    # IPPROTO_TCP named, as serve binds its own, or asyncio leaves Nagle on (40 ms stalls).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = Server([_DoNothing()])
    await server.start(sock=sock, ssl=server_context(TlsPaths.under(state_dir)))
    port_file.write_text(str(sock.getsockname()[1]))  # noqa: ASYNC240 - once, tiny
    await server.wait_closed()


@contextmanager
def do_nothing_server(state_dir: Path) -> Iterator[int]:
    """A do-nothing server with the coordinator's certificate under ``state_dir``; its port."""
    with tempfile.TemporaryDirectory(prefix="tp-bench-floor-") as tmp:
        port_file = Path(tmp) / "port"
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench._rpc_floor", str(state_dir), str(port_file)]
        )
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not port_file.exists() or not port_file.read_text():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the do-nothing gRPC server did not start")
                time.sleep(0.02)
            yield int(port_file.read_text())
        finally:
            proc.kill()
            proc.wait()


async def pairs_per_second(port: int, ca: Path, jobspec: str, count: int, in_flight: int) -> float:
    """Preview + Commit pairs per second against the do-nothing server, ``in_flight`` at once,
    after one unmeasured pair; the requests carry what the admissions figure's carry."""
    channel = Channel("127.0.0.1", port, ssl=grpc_client_context(ca))
    stub = v1.ApiStub(channel, metadata={"authorization": "Bearer bench"}, timeout=60)
    gate = asyncio.Semaphore(in_flight)

    async def one(i: int) -> None:
        async with gate:
            await stub.preview(v1.PreviewRequest(jobspec_json=jobspec))
            await stub.commit(v1.CommitRequest("pv-0123456789abcdef", "0" * 64, f"rk-{i}"))

    try:
        await one(-1)
        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(count)))
        return count / (time.perf_counter() - started)
    finally:
        channel.close()


if __name__ == "__main__":
    asyncio.run(_serve(Path(sys.argv[1]), Path(sys.argv[2])))
