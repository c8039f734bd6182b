"""The console's listener: uvicorn serving the console's ASGI app inside the coordinator's own
event loop and task group, over TLS with the coordinator's certificate.

Rules:
- uvicorn, not its ``run()``: :func:`run_console` awaits its server on a socket ``serve``
  already bound, and never lets it touch signals (the coordinator's own watcher owns SIGTERM
  and SIGINT, :mod:`~tuneplane.coordinator.server.serve`).
- Cancelled, it stops accepting, ends live streams, and gives requests in flight
  :data:`CLOSE_GRACE_S` to finish, shielded, as the gRPC listeners do.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
from collections.abc import Iterator

import anyio
import uvicorn
from anyio.abc import TaskStatus
from starlette.types import ASGIApp

from tuneplane.agent.host_port import join_host_port

from .app import Console

log = logging.getLogger(__name__)

CLOSE_GRACE_S = 5.0


class _EmbeddedServer(uvicorn.Server):
    """uvicorn's server without its signal handlers: the coordinator owns the process's signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def run_console(
    app: ASGIApp,
    console: Console,
    host: str,
    sock: socket.socket,
    ctx: ssl.SSLContext,
    *,
    task_status: TaskStatus[str],
) -> None:
    """Serve the console on ``sock`` until cancelled; started with the address it listens at."""
    config = uvicorn.Config(
        app,
        lifespan="off",
        log_config=None,
        access_log=False,
        proxy_headers=False,
        server_header=False,
        timeout_graceful_shutdown=int(CLOSE_GRACE_S),
        h11_max_incomplete_event_size=64 * 1024,
    )
    config.load()
    config.ssl = ctx  # the coordinator's certificate, one TLS setup (server/tls.py)
    server = _EmbeddedServer(config)
    address = join_host_port(host, sock.getsockname()[1])

    async def run() -> None:
        # Shielded: a cancel reaches it as should_exit, so uvicorn closes its connections.
        with anyio.CancelScope(shield=True):
            await server.serve(sockets=[sock])

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        try:
            while not server.started:  # uvicorn says so by a flag only
                await anyio.sleep(0.01)
            log.info("listener started name=console listening=%s", address)
            task_status.started(address)
            await anyio.sleep_forever()
        finally:
            console.closing.set()
            server.should_exit = True
            log.info("listener stopped name=console")
