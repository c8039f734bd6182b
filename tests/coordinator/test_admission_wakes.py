"""Who an admission wakes (coordinator/server/lead.py, ``admission_listener``).

The receipt of a new Job says which kind of Fleet admitted it. The Node scheduler is told of
every new Job; the Slurm executor is woken only by a Job on a Slurm Fleet, because its pass for
any other Job read the queue and found nothing: two store reads and a wake-up per admission
(issue 13, goal 2). A Slurm Job must still wake it at once, not a tick later. Real stores, a
real executor loop with a tick of an hour, so every pass it makes is one it was woken for.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.support.store_backend import current
from tuneplane.coordinator.catalogue import Catalogue
from tuneplane.coordinator.gateways.collector_credentials import CollectorCredentials
from tuneplane.coordinator.gateways.sessions import SessionRegistry
from tuneplane.coordinator.server.lead import admission_listener
from tuneplane.coordinator.server.scheduler import Scheduler
from tuneplane.coordinator.server.slurm_executor import SlurmExecutor
from tuneplane.coordinator.store.core import Store
from tuneplane.coordinator.store.logs import LogStore
from tuneplane.coordinator.store.telemetry import TelemetryStore
from tuneplane.coordinator.values.fleet import SlurmSettings
from tuneplane.coordinator.values.jobs import Preview, PreviewSummary, Receipt

pytestmark = pytest.mark.timeout(60)

#: A closed port: the executor's pass, once woken, fails to reach it at once.
SLURM = SlurmSettings("http://127.0.0.1:9", "/srv/tp/slurm.token", "gpu", "/shared")


async def _admit(store: Store, n: int, fleet: str, kind: str) -> Receipt:
    spec = {"project": "demo", "experiment": f"e-{n}", "method_id": "custom/custom",
            "resources": {"profile": "h200", "series": "h200", "gpus": 1}}  # fmt: skip
    summary = PreviewSummary(fleet, kind, "h200", 1, 1, "h200")
    await store.save_preview(Preview(f"pv-{n}", f"d{n}", json.dumps(spec), summary, n, "admin"))
    return await store.commit(f"pv-{n}", f"d{n}", f"rk-{n}", "admin", f"run-{n}", n)


async def _turns(count: int) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


def test_only_a_slurm_admission_wakes_the_slurm_executor(tmp_path: Path) -> None:
    async def go() -> None:
        store = await Store.open(current().where(tmp_path / "coordinator.db"))
        logs = await LogStore.open(current().where(tmp_path / "logs.db"))
        telemetry = await TelemetryStore.open(current().where(tmp_path / "telemetry.db"))
        try:
            await store.bootstrap("admin-token-hash", 1)
            await store.create_fleet("hpc", "slurm", 1, slurm=SLURM)
            catalogue = Catalogue.bundled()
            scheduler = Scheduler(store, SessionRegistry(), catalogue, 60, 3600)
            credentials = CollectorCredentials(telemetry, "127.0.0.1:7445", ())
            slurm = SlurmExecutor(
                store, catalogue, logs, credentials, tmp_path / "ca.pem", tick_s=3600
            )
            admitted = admission_listener(scheduler, slurm)
            runner = asyncio.create_task(slurm.run())
            try:
                node = await _admit(store, 1, "default", "node")
                assert (node.created, node.backend) == (True, "node")
                admitted(node.run_id, node.backend)
                await _turns(50)
                assert slurm.passes == 0

                again = await store.commit("pv-1", "d1", "rk-1", "admin", "run-x", 2)  # repeated
                assert (again.created, again.backend) == (False, "")

                job = await _admit(store, 2, "hpc", "slurm")
                assert (job.created, job.backend) == (True, "slurm")
                admitted(job.run_id, job.backend)
                async with asyncio.timeout(30):
                    while slurm.passes == 0:
                        await asyncio.sleep(0)
            finally:
                runner.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await runner
        finally:
            await telemetry.close()
            await logs.close()
            await store.close()

    asyncio.run(go())
