"""The Api's ``SetControlAddress`` (admin users only): what ``tuneplane-coordinator
control-address`` calls on a running coordinator
(:class:`~tuneplane.coordinator.gateways.control_address.ControlAddressDesk` checks, stores and
announces it).
"""

from __future__ import annotations

from typing import Any

from grpclib.const import Cardinality, Handler

from tuneplane.proto import v1

from ..gateways.control_address import ControlAddressDesk
from ..gateways.status import grpc_errors
from ..store.core import Store
from .fleet import admin_caller


class ControlAddressApi:
    """grpclib handler for ``tuneplane.v1.Api/SetControlAddress`` (admin users only)."""

    def __init__(self, store: Store, desk: ControlAddressDesk) -> None:
        self._store = store
        self._desk = desk

    def __mapping__(self) -> dict[str, Handler]:
        return {
            "/tuneplane.v1.Api/SetControlAddress": Handler(
                self._set,
                Cardinality.UNARY_UNARY,
                v1.SetControlAddressRequest,
                v1.SetControlAddressReply,
            ),
        }

    async def _set(self, stream: Any) -> None:
        with grpc_errors():
            user = await admin_caller(self._store, stream, "change the control address")
            request: v1.SetControlAddressRequest = await stream.recv_message()
            told = await self._desk.set(request.address, user.name)
            await stream.send_message(
                v1.SetControlAddressReply(address=self._desk.address, nodes_told=told)
            )
