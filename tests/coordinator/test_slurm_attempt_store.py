"""Attempts run as Slurm jobs in the store (SQLite and PostgreSQL, migration 18): a queued Job of
a Slurm Fleet is never placed on Nodes; its attempt is written before any submit; the Slurm job
id is recorded once; the Job's state follows what Slurm says, ``unknown`` while slurmrestd is
silent, and keeps ``running`` when Slurm requeues a job that ran; an ended Job is no longer
driven."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import attrs
import pytest

from tests.support.store_backend import current
from tuneplane.coordinator.slurm_attempt import SlurmAttemptFacts
from tuneplane.coordinator.store.core import Store
from tuneplane.coordinator.store.queue_status import queued_requests
from tuneplane.coordinator.store.slurm_attempts import (
    queued_slurm_jobs,
    record_slurm_facts,
    record_slurm_job_id,
    reserve_slurm_attempt,
    slurm_attempt_inputs,
    slurm_attempts_to_drive,
)
from tuneplane.coordinator.values.fleet import SlurmSettings
from tuneplane.coordinator.values.jobs import Preview, PreviewSummary

pytestmark = pytest.mark.timeout(60)

SETTINGS = SlurmSettings("http://slurm.example:6820", "/srv/tp/slurm.token", "gpu", "/shared")
SPEC = {"project": "demo", "experiment": "hello", "method_id": "custom/custom",
        "resources": {"profile": "hpc", "series": "h200", "gpus": 4, "members": 2}}  # fmt: skip


async def _admitted(store: Store) -> str:
    await store.bootstrap("admin-token-hash", 1)
    await store.create_fleet("hpc", "slurm", 1, slurm=SETTINGS)
    summary = PreviewSummary("hpc", "slurm", "h200", 2, 2, "hpc")
    await store.save_preview(Preview("pv-1", "d1", json.dumps(SPEC), summary, 2, "admin"))
    receipt = await store.commit("pv-1", "d1", "rk-1", "admin", "run-1", 3)
    return receipt.run_id


async def _state(store: Store, run_id: str) -> tuple[str, str]:
    job = await store.get_job(run_id)
    return job.state, job.state_reason


def test_a_slurm_attempt_is_written_then_its_job_id_then_slurms_word(tmp_path: Path) -> None:
    async def go() -> None:
        store = await Store.open(current().where(tmp_path / "coordinator.db"))
        try:
            run_id = await _admitted(store)
            assert await queued_slurm_jobs(store) == [run_id]
            queue, _, _ = await queued_requests(store)
            assert queue == []  # never placed on Nodes
            queued = await store.queued_job(run_id)
            assert queued is not None
            sealed = {"capsule.json": "{}\n"}
            number = await reserve_slurm_attempt(store, queued, lambda a, m: sealed, 4)
            assert number == 1
            assert await reserve_slurm_attempt(store, queued, lambda a, m: sealed, 5) is None
            assert await _state(store, run_id) == (
                "reserved",
                "the attempt is recorded; submitting it to Slurm",
            )
            [row] = await slurm_attempts_to_drive(store)
            assert (row.job_name, row.members, row.gpus_per_member) == ("tp-run-1-a1", 2, 2)
            assert row.facts == SlurmAttemptFacts() and row.cancel_grace_s is None
            assert await slurm_attempt_inputs(store, run_id, 1) == (json.dumps(SPEC), sealed)

            await record_slurm_job_id(store, run_id, 1, 41, False, 6)
            await record_slurm_job_id(store, run_id, 1, 42, True, 7)  # never replaces 41
            [row] = await slurm_attempts_to_drive(store)
            assert row.facts.job_id == 41

            running = SlurmAttemptFacts(job_id=41, slurm_state="RUNNING")
            await record_slurm_facts(store, run_id, 1, running, 8)
            assert await _state(store, run_id) == ("running", "Slurm job 41 is running")
            # Slurm requeued it (pending again, restarted once): back to reserved, saying so.
            requeued = SlurmAttemptFacts(job_id=41, slurm_state="PENDING",
                                         slurm_reason="BeginTime", restarts=1)  # fmt: skip
            await record_slurm_facts(store, run_id, 1, requeued, 8)
            assert await _state(store, run_id) == (
                "reserved",
                "Slurm job 41 was requeued by Slurm (1 time) and is pending again (BeginTime)",
            )
            [row] = await slurm_attempts_to_drive(store)
            assert row.facts == requeued
            await record_slurm_facts(store, run_id, 1, attrs.evolve(running, restarts=1), 8)
            assert await _state(store, run_id) == ("running", "Slurm job 41 is running")
            silent = SlurmAttemptFacts(job_id=41, slurm_state="RUNNING", reachable=False,
                                       unreachable_why="no answer.")  # fmt: skip
            await record_slurm_facts(store, run_id, 1, silent, 9)
            assert await _state(store, run_id) == (
                "unknown",
                "slurmrestd does not answer (no answer)",
            )
            done = SlurmAttemptFacts(job_id=41, slurm_state="COMPLETED", has_exit=True)
            await record_slurm_facts(store, run_id, 1, done, 10)
            assert (await _state(store, run_id))[0] == "succeeded"
            assert await slurm_attempts_to_drive(store) == []
        finally:
            await store.close()

    asyncio.run(go())
