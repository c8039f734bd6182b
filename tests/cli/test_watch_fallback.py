"""`tp job show --watch` against a coordinator older than WatchJob: it polls GetJob instead.

The coordinator here is a real grpclib server on loopback TLS, with a real coordinator's
certificate (``tuneplane-coordinator init``), that serves GetJob and nothing else: WatchJob is
answered UNIMPLEMENTED by grpclib itself, as an older coordinator answers it.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import anyio
import pytest
from grpclib.const import Cardinality, Handler
from grpclib.server import Server

from tests.support.coordinator import admin_argv
from tuneplane.coordinator.cli.api_client import ApiClient
from tuneplane.coordinator.cli.api_errors import NotServed
from tuneplane.coordinator.cli.connection import Endpoint
from tuneplane.coordinator.cli.watch import _follow
from tuneplane.coordinator.server.tls import TlsPaths, server_context
from tuneplane.proto import v1

RUN_ID = "run-0123456789ab"
#: What GetJob answers, one state per call; the last one again for any later call.
STATES = ("queued", "running", "succeeded")
WAIT_S = 60.0
T = TypeVar("T")


class OlderApi:
    """GetJob only: each call answers the next of :data:`STATES`."""

    def __init__(self) -> None:
        self.calls = 0

    def __mapping__(self) -> dict[str, Handler]:
        return {
            "/tuneplane.v1.Api/GetJob": Handler(
                self._get_job, Cardinality.UNARY_UNARY, v1.GetJobRequest, v1.Job
            )
        }

    async def _get_job(self, stream: Any) -> None:
        request: v1.GetJobRequest = await stream.recv_message()
        state = STATES[min(self.calls, len(STATES) - 1)]
        self.calls += 1
        await stream.send_message(
            v1.Job(run_id=request.run_id, state=state, owner="ada", project="demo")
        )


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A coordinator's state directory (its CA and server certificate), never served."""
    path = tmp_path_factory.mktemp("older") / "coordinator"
    subprocess.run(
        admin_argv("init", "--state-dir", str(path)), check=True, capture_output=True, timeout=60
    )
    return path


def _run(main: Coroutine[Any, Any, T]) -> T:
    """``main`` on a plain asyncio loop. Once a test in this pytest worker imported trio_asyncio
    (the agent's tests do), ``asyncio.run`` makes a trio-asyncio loop, on which a server and its
    client in one loop lose their connection; ``tp`` never loads trio_asyncio."""
    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        return runner.run(main)


async def _serving(state_dir: Path, api: OlderApi) -> tuple[Server, Endpoint]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = Server([api])
    await server.start(sock=sock, ssl=server_context(TlsPaths.under(state_dir)))
    port = sock.getsockname()[1]
    return server, Endpoint("127.0.0.1", port, state_dir / "tls" / "ca.pem", "token")


def test_the_watch_polls_get_job_when_the_coordinator_has_no_watch_job(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    api = OlderApi()

    async def go() -> str:
        server, endpoint = await _serving(state_dir, api)
        try:
            with anyio.fail_after(WAIT_S):
                job = await _follow(endpoint, RUN_ID, True, 0.2)
        finally:
            server.close()
            await server.wait_closed()
        return job.state

    assert _run(go()) == "succeeded"
    out, err = capsys.readouterr()
    # One JSON object per change, in order; nothing said about the fallback.
    assert [json.loads(line)["state"] for line in out.splitlines()] == list(STATES)
    assert api.calls == len(STATES)
    assert "WatchJob" not in out + err and "UNIMPLEMENTED" not in out + err


def test_the_client_says_the_coordinator_does_not_serve_watch_job(state_dir: Path) -> None:
    async def go() -> None:
        server, endpoint = await _serving(state_dir, OlderApi())
        try:
            async with ApiClient(endpoint) as client:
                with anyio.fail_after(WAIT_S), pytest.raises(NotServed):
                    async for _ in client.watch_job(RUN_ID):
                        raise AssertionError("an older coordinator sent a Job on WatchJob")
        finally:
            server.close()
            await server.wait_closed()

    _run(go())
