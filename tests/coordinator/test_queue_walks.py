"""What an admission costs the store does not grow with the queue (issue 13, goal 2).

An admission wakes the Node scheduler, whose pass plans only the new Job, and the Slurm
executor, which reserves the queued Jobs of Slurm Fleets. Neither may walk the whole queue: a
coordinator with 10,000 Jobs queued admits as fast as one with none. The work is counted, not
timed: SQLite calls a progress handler every few virtual-machine instructions, so a statement
that walks an index range of the queue costs instructions in proportion to it, on any machine
and at any load. The same admission is counted behind a short and a long queue of Jobs on a
Fleet of Nodes, with one Slurm Fleet's Job queued beside them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from pathlib import Path

import pytest

from tuneplane.coordinator.catalogue import Catalogue
from tuneplane.coordinator.gateways.sessions import SessionRegistry
from tuneplane.coordinator.server.scheduler import Scheduler
from tuneplane.coordinator.store.core import Store, db_path
from tuneplane.coordinator.store.slurm_attempts import queued_slurm_jobs
from tuneplane.coordinator.store.sqlite import SqliteBackend
from tuneplane.coordinator.values.fleet import SlurmSettings
from tuneplane.coordinator.values.jobs import Preview, PreviewSummary

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.sqlite_only("it counts SQLite's virtual-machine instructions"),
]

SHORT, LONG = 5, 400
#: Instructions between two calls of the progress handler.
GRAIN = 10
SLURM = SlurmSettings("http://slurm.example:6820", "/srv/tp/slurm.token", "gpu", "/shared")


async def _admit(store: Store, n: int, fleet: str = "default", kind: str = "node") -> str:
    profile = "hpc" if kind == "slurm" else "h200"
    spec = {"project": "demo", "experiment": f"e-{n}", "method_id": "custom/custom",
            "resources": {"profile": profile, "series": "h200", "gpus": 1}}  # fmt: skip
    summary = PreviewSummary(fleet, kind, "h200", 0, 0, profile)
    await store.save_preview(Preview(f"pv-{n}", f"d{n}", json.dumps(spec), summary, n, "admin"))
    receipt = await store.commit(f"pv-{n}", f"d{n}", f"rk-{n}", "admin", f"run-{n}", n)
    return receipt.run_id


class Counter:
    """Progress-handler calls on the store's own SQLite connection."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> int:
        self.calls += 1
        return 0  # go on


async def _counted(store: Store, counter: Counter, work: Awaitable[object]) -> int:
    backend = store._backend  # the store's one connection: what the coordinator's reads cost
    assert isinstance(backend, SqliteBackend)
    before = counter.calls
    # Set while the store's thread is idle (nothing is awaited here): it runs in no other.
    backend._link.set_progress_handler(counter, GRAIN)
    try:
        await work
    finally:
        backend._link.set_progress_handler(None, GRAIN)
    return counter.calls - before


def _costs(tmp_path: Path, queued: int) -> tuple[int, int]:
    """With ``queued`` Jobs waiting on a Fleet with no Nodes and one on a Slurm Fleet: the
    instructions of the pass that plans one more admitted Job, and of the Slurm executor's read
    of its queue."""

    tmp_path.mkdir()

    async def go() -> tuple[int, int]:
        store = await Store.open(db_path(tmp_path))
        try:
            await store.bootstrap("admin-token-hash", 1)
            await store.create_fleet("hpc", "slurm", 1, slurm=SLURM)
            await _admit(store, 0, "hpc", "slurm")
            for n in range(1, queued + 1):
                await _admit(store, n)
            scheduler = Scheduler(store, SessionRegistry(), Catalogue.bundled(), 60, 3600)
            await scheduler.step()  # the whole pass an admission's pass builds on
            new = await _admit(store, queued + 1)
            counter = Counter()
            planned = await _counted(store, counter, scheduler.step({new}))
            assert scheduler.partial_passes == 1
            slurm = await _counted(store, counter, queued_slurm_jobs(store))
            assert (await store.get_job(new)).state_reason.startswith("waiting: needs 1 h200")
            return planned, slurm
        finally:
            await store.close()

    return asyncio.run(go())


def test_an_admissions_pass_and_the_slurm_read_cost_the_same_behind_a_long_queue(
    tmp_path: Path,
) -> None:
    short = _costs(tmp_path / "short", SHORT)
    long = _costs(tmp_path / "long", LONG)
    print(f"instructions/{GRAIN}: behind {SHORT} queued {short}, behind {LONG} queued {long}")
    # 80 times the queue, and the same work give or take what a deeper index's search costs.
    assert long[0] <= short[0] * 1.25 + 10
    assert long[1] <= short[1] * 1.25 + 10
