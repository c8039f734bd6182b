"""Telling Nodes a new control address (``tuneplane-coordinator control-address``).

Rules (docs/operator.md, "Moving the coordinator"):
- One address at a time, kept in the store (:mod:`~tuneplane.coordinator.store.control_address`)
  with who set it and when, and each change is a decision. Empty means none: Nodes keep dialing
  what they enrolled with.
- It goes to every connected Node at once (ControlAddress) and in every later Welcome; a Node
  stores it, keeps the one it dialed as a fallback, and dials it at its next connect. Which
  address each Node last dialed is recorded at Hello (``nodes.dialed_address``), so the operator
  sees who has followed before the old address goes away.
- The address must be ``HOST:PORT`` and its host must be a name or address the coordinator's
  server certificate covers: a Node verifies the certificate, so any other address would only
  strand it. The refusal names the certificate and how to add the name.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from cryptography import x509
from grpclib.const import Cardinality, Handler

from tuneplane.agent.host_port import split_host_port
from tuneplane.proto import v1
from tuneplane.proto.contract.input_checks import InputRefused

from ..api.fleet import admin_caller
from ..clock import now_ms
from ..gateways.sessions import SessionRegistry
from ..gateways.status import grpc_errors
from ..store import control_address as store_control_address
from ..store.core import Store
from . import tls

log = logging.getLogger(__name__)


class BadAddress(InputRefused):
    """The address is not HOST:PORT, or the server certificate does not cover its host."""


def split(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT``) -> (host, port), read by
    :func:`tuneplane.agent.host_port.split_host_port`. Raises :class:`BadAddress`."""
    found = split_host_port(address)
    if found is None:
        raise BadAddress(
            f"The control address {address!r}",
            "is not HOST:PORT (for IPv6, [ADDRESS]:PORT)",
            "Give the name or address Nodes will dial and the control port, e.g. "
            "coordinator.example.org:7444.",
        )
    return found


def check(address: str, server_cert: Path) -> str:
    """``address`` when Nodes could use it (empty: clear); else :class:`BadAddress`."""
    if not address:
        return ""
    host, _ = split(address)
    cert = x509.load_pem_x509_certificate(server_cert.read_bytes())
    if not tls.covers(cert, host):
        covered = tls.certificate_names(cert)
        raise BadAddress(
            f"The control address {address!r}",
            f"names {host!r}, which the coordinator's server certificate {server_cert} does not "
            f"cover (it covers {', '.join(sorted(covered)) or 'no names'}), so every Node "
            "dialing it would refuse the coordinator",
            'Issue a certificate that names it (docs/operator.md, "Moving the coordinator") '
            "or give a name it covers.",
        )
    return address


class ControlAddressDesk:
    """The address in memory for every Welcome, and the one place that changes it."""

    def __init__(self, store: Store, registry: SessionRegistry, server_cert: Path) -> None:
        self._store = store
        self._registry = registry
        self._server_cert = server_cert
        self.address = ""

    async def load(self) -> None:
        self.address = await store_control_address.current(self._store)

    async def set(self, address: str, by: str) -> int:
        """Check, store and announce ``address``; returns how many connected Nodes were told."""
        checked = check(address, self._server_cert)
        await store_control_address.record(self._store, checked, by, now_ms())
        self.address = checked
        if not checked:
            return 0
        message = v1.CoordinatorMessage(control_address=v1.ControlAddress(address=checked))
        told = sum(self._registry.send(n, message) for n in self._registry.connected_nodes())
        log.info("control address set address=%s by=%s nodes_told=%d", checked, by, told)
        return told


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
