"""The telemetry gateway (``tuneplane.v1.Telemetry``), on its own listener.

Rules: every call is authenticated. For now the accepted credential is a user token (the admin
token is one); credentials scoped to one run/attempt/member for collectors are not issued yet.
"""

from __future__ import annotations

from typing import Any

from grpclib.const import Cardinality, Handler

from tuneplane.coordinator.api_service import user_principal
from tuneplane.coordinator.clock import now_ms
from tuneplane.coordinator.store import Store
from tuneplane.coordinator.wire import grpc_errors
from tuneplane.proto import v1


class TelemetryGateway:
    """grpclib handlers for ``tuneplane.v1.Telemetry``."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def __mapping__(self) -> dict[str, Handler]:
        return {
            "/tuneplane.v1.Telemetry/Ping": Handler(
                self._ping, Cardinality.UNARY_UNARY, v1.PingRequest, v1.PingReply
            ),
        }

    async def _ping(self, stream: Any) -> None:
        with grpc_errors():
            principal = await user_principal(self._store, stream)
            await stream.recv_message()
            await stream.send_message(
                v1.PingReply(
                    server_time_ms=now_ms(), principal=f"{principal.kind}:{principal.name}"
                )
            )
