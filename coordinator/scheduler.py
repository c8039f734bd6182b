"""The scheduler task: places queued Jobs and aborts launches whose Prepare timed out.

Rules:
- One scheduler task per coordinator, so placement decisions never race each other; the store's
  reservation key would refuse an over-commit anyway.
- It wakes on events (a Job admitted, a Node connected, GPUs released) and at least every tick.
- Placement itself is the pure :func:`tuneplane.coordinator.placement.place`; this shell only
  reads offers, writes the reservation and sends Prepare.
"""

from __future__ import annotations

import logging

import anyio

from tuneplane.coordinator import capsule, jobspec
from tuneplane.coordinator.catalogue import Catalogue
from tuneplane.coordinator.clock import now_ms
from tuneplane.coordinator.placement import Request, place
from tuneplane.coordinator.records import QueuedJob
from tuneplane.coordinator.sessions import SessionRegistry
from tuneplane.coordinator.store import Store

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        store: Store,
        registry: SessionRegistry,
        catalogue: Catalogue,
        prepare_timeout_s: float,
        tick_s: float = 1.0,
    ) -> None:
        self._store = store
        self._registry = registry
        self._catalogue = catalogue
        self._prepare_timeout_ms = int(prepare_timeout_s * 1000)
        self._tick_s = tick_s
        self._wake = anyio.Event()

    def wake(self) -> None:
        """Ask for a scheduling pass soon (safe to call from any coordinator task)."""
        self._wake.set()

    async def run(self) -> None:
        """Schedule until cancelled."""
        while True:
            with anyio.move_on_after(self._tick_s):
                await self._wake.wait()
            self._wake = anyio.Event()
            await self.step()

    async def step(self) -> None:
        """One pass: abort expired launches, then try to place every queued Job in order."""
        self._registry.dispatch(await self._store.abort_expired_prepares(now_ms()))
        for job in await self._store.queued_jobs():
            await self._try_place(job)

    async def _try_place(self, job: QueuedJob) -> None:
        offers = [
            o
            for o in await self._store.offers(job.fleet, job.series)
            if self._registry.is_connected(o.node_id)
        ]
        placement = place(Request(job.gpus, job.members, job.gpus_per_member), offers)
        if placement is None:
            return
        spec = jobspec.loads(job.resolved_json)
        recipe = self._catalogue.get(spec.method_id)
        launcher = recipe.launcher if recipe is not None else "member"
        count = len(placement.members)
        now = now_ms()
        orders = await self._store.reserve_launch(
            job,
            placement,
            lambda attempt: capsule.seal(spec, launcher, job.run_id, attempt, count),
            now + self._prepare_timeout_ms,
            now,
        )
        if orders is None:
            return
        log.info(
            "launch reserved run_id=%s members=%d gpus_per_member=%d nodes=%s",
            job.run_id,
            count,
            placement.gpus_per_member,
            ",".join(m.node_id for m in placement.members),
        )
        self._registry.dispatch(list(orders))
