"""The gRPC listeners ``serve`` runs: each service's handlers bounded and timed, and a grpclib
server on an already bound socket.

Rules:
- Every request is bounded before it is decoded
  (:mod:`~tuneplane.coordinator.gateways.message_limits`), by the listener's ``[limits]``
  setting; Enroll, the one unauthenticated call, by its own.
- A listener reports its address only once it accepts, and closes shielded when cancelled.
- Its backlog holds a whole Fleet dialing at once (:data:`LISTEN_BACKLOG`).
"""

from __future__ import annotations

import logging
import socket
import ssl
from typing import Any

import anyio
from anyio.abc import TaskStatus
from grpclib.server import Server

from tuneplane.agent.host_port import join_host_port

from ..config import Limits
from ..gateways.message_limits import bounded_handlers
from ..gateways.status import grpc_errors
from .metrics_export import timed_handlers

log = logging.getLogger(__name__)

ENROLL_METHOD = "/tuneplane.v1.Control/Enroll"
#: Connections the kernel queues on each listener before the coordinator accepts them (capped
#: by net.core.somaxconn; grpclib's own default is 100). After a restart or a takeover every
#: Node dials within about a second, each on a connection of its own; past the backlog the
#: kernel drops a SYN, and the Node's kernel sends it again only after 1 s, then 3 s: past its
#: 3 s connect deadline.
LISTEN_BACKLOG = 4096
#: How long a closing listener waits for its calls still running.
CLOSE_GRACE_S = 10.0


def bounded(listener: str, services: list[Any], limits: Limits) -> list[Any]:
    """The listener's services with every request bounded before decoding (message_limits)."""
    size = getattr(limits, f"{listener}_message_bytes")
    per_method = {}
    if listener == "control":
        per_method[ENROLL_METHOD] = (
            limits.enroll_message_bytes,
            "[limits] enroll_message_bytes in coordinator.toml",
        )
    default = (size, f"[limits] {listener}_message_bytes in coordinator.toml")
    # Timed outermost: the RPC latency metric sees every call, refusals by the bounds included.
    return timed_handlers(bounded_handlers(services, per_method, default, grpc_errors))


async def run_listener(
    name: str,
    handlers: list[Any],
    host: str,
    sock: socket.socket,
    ctx: ssl.SSLContext,
    *,
    task_status: TaskStatus[str],
) -> None:
    """Serve ``handlers`` over TLS on ``sock`` until cancelled; started with the address it
    listens at."""
    server = Server(handlers)
    await server.start(sock=sock, ssl=ctx, backlog=LISTEN_BACKLOG)
    address = join_host_port(host, sock.getsockname()[1])
    log.info("listener started name=%s listening=%s", name, address)
    try:
        task_status.started(address)
        await anyio.sleep_forever()
    finally:
        with anyio.CancelScope(shield=True):
            server.close()
            # Handlers end with their sessions; one stuck on a dead link (a coordinator cut off
            # from its database, stepping down) must not keep the listener for ever.
            with anyio.move_on_after(CLOSE_GRACE_S) as waited:
                await server.wait_closed()
            if waited.cancelled_caught:
                log.warning("listener stopped with calls still running name=%s grace_s=%g",
                            name, CLOSE_GRACE_S)  # fmt: skip
            log.info("listener stopped name=%s", name)
