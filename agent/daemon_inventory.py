"""The daemon's inventory: probed on an interval, with the GPUs' XIDs journaled and the XID book
applied before it is made current; and the metrics listener's snapshot.

Rules: GPU health is what the probe found plus the XID book (agent/xid_book.py): XIDs drained
from NVML are journaled before the inventory that reflects them is made current (so before it is
sent), and every refresh reads the book back, so an operator's ``gpu clear`` takes effect at the
next refresh. Launch asks for a refresh of its own (MemberManager re-checks on it). A read that
fails marks every known GPU unhealthy with why.
"""

from __future__ import annotations

import logging

import attrs
import trio

from .collectors import COLLECTORS_DIR
from .crashpoint import crashpoint
from .daemon_base import DaemonBase
from .daemon_status import inventory_summary
from .inventory import Inventory, InventoryError
from .inventory_source import probe
from .members_base import now_ms
from .xid_book import judge

log = logging.getLogger(__name__)


class DaemonInventory(DaemonBase):
    """Keep the inventory current (with the XID book applied) and the metrics snapshot fresh."""

    async def inventory_loop(self) -> None:
        """Refresh the inventory every ``inventory_interval_s``."""
        while True:
            await trio.sleep(self.inventory_interval_s)
            await self.refresh_inventory()

    async def _probe(self) -> Inventory:
        """What the GPUs say now. A read that fails marks every known GPU unhealthy with why."""
        try:
            return await probe(self.source)
        except InventoryError as exc:
            log.error("inventory refresh failed reason=%s", exc)
            reason = str(exc)
            return attrs.evolve(
                self.inventory,
                gpus=tuple(
                    attrs.evolve(g, healthy=False, health_reason=reason)
                    for g in self.inventory.gpus
                ),
            )

    async def refresh_inventory(self) -> Inventory:
        """Probe, journal the XIDs NVML reported, apply the XID book, and make that current.

        The XIDs (and any recovery-action change) are committed to the journal before the
        inventory that reflects them replaces the current one, so nothing the coordinator is
        told about a GPU is missing from the journal after a crash.
        """
        async with self.inventory_lock:
            probed = await self._probe()
            inventory = probed
            if self.journal is not None:
                drained = self.source.take_xid_events()
                written = await self.journal.record_xids(
                    [judge(e.uuid, e.xid, e.at_ms) for e in drained]
                )
                for x in written:
                    log.warning("gpu xid journaled gpu_uuid=%s xid=%d application=%s",
                                x.uuid or "unidentified", x.xid, x.application)  # fmt: skip
                if written:
                    crashpoint("after-xid-journaled")
                book = await self.journal.xid_book()
                changes = book.observe(probed, now_ms())
                if changes:
                    await self.journal.record_health_events(changes)
                    for c in changes:
                        log.warning("gpu health event gpu_uuid=%s kind=%s reason=%s", c.uuid,
                                    c.kind, c.reason)  # fmt: skip
                    book = await self.journal.xid_book()
                inventory = book.apply(probed)
            if inventory != self.inventory:
                log.info("inventory changed gpus=%d source=%s unhealthy=%d", len(inventory.gpus),
                         inventory.gpu_source,
                         sum(not g.healthy for g in inventory.gpus))  # fmt: skip
                self.inventory = inventory
                self.status.inventory = inventory_summary(inventory)
            return inventory

    async def metrics_loop(self) -> None:
        """Refresh what the metrics listener serves, while it is on (agent/metrics.py)."""
        # Started only when node.toml has [metrics]: without it the agent never loads
        # prometheus_client (agent/metric_hooks.py).
        from .metrics import SNAPSHOT_INTERVAL_S, refresh_snapshot

        while True:
            await refresh_snapshot(self.journal, self.inventory, self.state.root / COLLECTORS_DIR)
            await trio.sleep(SNAPSHOT_INTERVAL_S)
