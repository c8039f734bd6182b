"""Telling Nodes a new control address (``tuneplane-coordinator control-address``): the
address in memory for every Welcome, stored and announced to every connected Node.

Rules (docs/operator.md, "Moving the coordinator"):
- One address at a time, kept in the store (:mod:`~tuneplane.coordinator.store.control_address`)
  with who set it and when, and each change is a decision. Empty means none: Nodes keep dialing
  what they enrolled with.
- It goes to every connected Node at once (ControlAddress) and in every later Welcome; a Node
  stores it, keeps the one it dialed as a fallback, and dials it at its next connect. Which
  address each Node last dialed is recorded at Hello (``nodes.dialed_address``), so the operator
  sees who has followed before the old address goes away.
- The coordinators sharing the store (high availability) go in every Welcome and, when they
  change, to every connected Node whose agent announced ``coordinators-update``
  (:meth:`ControlAddressDesk.share_coordinators`); an older agent learns them at its next Welcome.
- The address is checked first (:func:`~tuneplane.coordinator.control_address.check`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from tuneplane.proto import v1
from tuneplane.proto.contract.control_protocol import Capability

from ..clock import now_ms
from ..control_address import check
from ..store import control_address as store_control_address
from ..store.core import Store
from .sessions import SessionRegistry

log = logging.getLogger(__name__)


class ControlAddressDesk:
    """The address in memory for every Welcome, and the one place that changes it."""

    def __init__(self, store: Store, registry: SessionRegistry, server_cert: Path) -> None:
        self._store = store
        self._registry = registry
        self._server_cert = server_cert
        self.address = ""
        #: Every coordinator's control address when several share the store (this one, the
        #: leader, first), for every Welcome; () when it serves alone. Changed by
        #: :meth:`share_coordinators`.
        self.coordinators: tuple[str, ...] = ()

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

    def share_coordinators(self, coordinators: tuple[str, ...]) -> int:
        """Name ``coordinators`` in every Welcome from now on and, when they changed, tell every
        connected Node that takes a Coordinators message; returns how many were told."""
        if coordinators == self.coordinators:
            return 0
        self.coordinators = coordinators
        message = v1.CoordinatorMessage(coordinators=v1.Coordinators(addresses=list(coordinators)))
        nodes = self._registry.nodes_that_take(Capability.COORDINATORS_UPDATE)
        told = sum(self._registry.send(n, message) for n in nodes)
        log.info("coordinators shared coordinators=%s nodes_told=%d",
                 ",".join(coordinators) or "-", told)  # fmt: skip
        return told
