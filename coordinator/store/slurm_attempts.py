"""Attempts run as Slurm jobs: written before submitting, the job id recorded after, Slurm's word
recorded at each poll, a cancel's steps recorded before they are taken.

Rules:
- The attempt, its ``slurm_attempts`` row (named by the attempt) and the reservation decision
  are one transaction, committed before anything reaches slurmrestd; the job id is recorded in
  its own transaction, with a ``slurm submitted`` decision, before the submission counts as
  done. A crash in between leaves a row with no job id, which the executor resolves by name.
- Every write that changes what the Job's state derives from ends with ``refresh_job``; the
  derivation of a Slurm attempt is :func:`tuneplane.coordinator.slurm_attempt.derive_job_state`.
- Nothing here decides; the executor (``server/slurm_executor.py``) does, from these reads.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import attrs

from tuneplane.proto.contract.slurm_attempt import job_name

from .. import lifecycle as lc
from ..slurm_attempt import SlurmAttemptFacts, shape
from ..values.jobs import QueuedJob
from .core import NotFound, Store
from .fleet_rows import fetch_rows
from .handle import first_row
from .slurm_facts import facts_of

_LIVE = tuple(lc.TERMINAL_JOB_STATES)


@attrs.frozen
class SlurmAttemptRow:
    """One attempt of a live Job on a Slurm Fleet, as the executor drives it."""

    run_id: str
    attempt: int
    fleet: str
    job_name: str
    members: int
    gpus_per_member: int
    facts: SlurmAttemptFacts
    signalled_at_ms: int | None
    cancelled_at_ms: int | None
    # Set when a person cancelled the attempt: the grace period its SIGTERM gives.
    cancel_grace_s: int | None
    # What it asks Slurm for, fixed when it was written: a gpu GRES type, a node feature.
    gres_type: str = ""
    constraint: str = ""


async def queued_slurm_jobs(store: Store) -> list[str]:
    """Run ids of queued Jobs whose Fleet is of kind slurm, oldest first.

    Read Fleet by Fleet from the Slurm Fleets (``CROSS JOIN`` keeps them the outer loop in
    SQLite), each by the ``jobs_by_fleet_state`` index: the executor runs at every admission,
    and Jobs queued on other Fleets must cost it nothing however many there are."""
    rows = await fetch_rows(
        store,
        "SELECT j.run_id FROM slurm_fleets s CROSS JOIN jobs j "
        "WHERE j.fleet = s.fleet AND j.state = ? ORDER BY j.created_at_ms, j.run_id",
        (lc.QUEUED,),
    )
    return [str(r[0]) for r in rows]


async def reserve_slurm_attempt(
    store: Store, job: QueuedJob, seal_capsule: Callable[[int, int], dict[str, str]], now: int
) -> int | None:
    """Write the next attempt of a queued Job as a Slurm job to submit (the Commit decision is
    the submission itself: there is no Prepare on Slurm). ``seal_capsule(attempt, members)``
    gives the capsule recorded with it. Returns the attempt number; None when the Job is no
    longer queued."""
    nodes, gpus_per_node = shape(job.gpus, job.members, job.gpus_per_member)

    async def work() -> int | None:
        async with store.transaction() as db:
            row = await first_row(db, "SELECT state FROM jobs WHERE run_id = ?", (job.run_id,))
            if row is None or row[0] != lc.QUEUED:
                return None
            (last,) = await first_row(
                db, "SELECT COALESCE(MAX(number), 0) FROM attempts WHERE run_id = ?", (job.run_id,)
            )
            number = int(last) + 1
            capsule = json.dumps(seal_capsule(number, nodes), sort_keys=True)
            name = job_name(job.run_id, number)
            # The Series' mapping now is what this attempt asks for, whatever changes later.
            mapped = await first_row(
                db, "SELECT gres_type, node_constraint FROM slurm_fleet_series "
                "WHERE fleet = ? AND series = ?", (job.fleet, job.series),
            )  # fmt: skip
            gres_type, constraint = (str(mapped[0]), str(mapped[1])) if mapped else ("", "")
            await db.execute(
                "INSERT INTO attempts (run_id, number, decision, decision_reason, decided_at_ms, "
                "prepare_deadline_ms, capsule_json, created_at_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (job.run_id, number, lc.COMMIT, "submitted to Slurm", now, now, capsule, now),
            )
            await db.execute(
                "INSERT INTO slurm_attempts (run_id, attempt, fleet, job_name, members, "
                "gpus_per_member, gres_type, node_constraint, updated_at_ms) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (job.run_id, number, job.fleet, name, nodes, gpus_per_node, gres_type,
                 constraint, now),
            )  # fmt: skip
            detail = {"fleet": job.fleet, "slurm_job_name": name, "nodes": nodes,
                      "gpus_per_node": gpus_per_node, "gres_type": gres_type,
                      "constraint": constraint}  # fmt: skip
            await store.log_decision(db, now, "reservation", detail, run_id=job.run_id)
            await store.refresh_job(db, job.run_id, now)
            return number

    return await store.shielded(work)


async def slurm_attempts_to_drive(store: Store) -> list[SlurmAttemptRow]:
    """The latest attempt of every Job on a Slurm Fleet that has not ended."""
    marks = ", ".join("?" for _ in _LIVE)
    rows = await fetch_rows(
        store,
        "SELECT s.run_id, s.attempt, s.fleet, s.job_name, s.members, s.gpus_per_member, "
        "s.slurm_job_id, s.slurm_state, s.slurm_reason, s.reachable, s.unreachable_why, "
        "s.has_exit, s.exit_code, s.signal, s.restarts, s.signalled_at_ms, s.cancelled_at_ms, "
        "(SELECT t.grace_period_s FROM attempt_stops t WHERE t.run_id = s.run_id "
        " AND t.attempt = s.attempt AND t.kind = 'cancel'), s.gres_type, s.node_constraint "
        "FROM slurm_attempts s JOIN jobs j ON j.run_id = s.run_id "
        f"WHERE j.state NOT IN ({marks}) AND s.attempt = "
        "(SELECT MAX(a.number) FROM attempts a WHERE a.run_id = s.run_id) "
        "ORDER BY s.run_id",
        _LIVE,
    )
    return [
        SlurmAttemptRow(
            run_id=str(r[0]),
            attempt=int(r[1]),
            fleet=str(r[2]),
            job_name=str(r[3]),
            members=int(r[4]),
            gpus_per_member=int(r[5]),
            facts=facts_of(r[6:15]),
            signalled_at_ms=None if r[15] is None else int(r[15]),
            cancelled_at_ms=None if r[16] is None else int(r[16]),
            cancel_grace_s=None if r[17] is None else int(r[17]),
            gres_type=str(r[18]),
            constraint=str(r[19]),
        )
        for r in rows
    ]


async def record_slurm_job_id(
    store: Store, run_id: str, attempt: int, job_id: int, found_by_name: bool, now: int
) -> None:
    """Record the Slurm job id of an attempt (once: a recorded id is never replaced)."""

    async def work() -> None:
        async with store.transaction() as db:
            cursor = await db.execute(
                "UPDATE slurm_attempts SET slurm_job_id = ?, submitted_at_ms = ?, "
                "updated_at_ms = ? WHERE run_id = ? AND attempt = ? AND slurm_job_id IS NULL",
                (job_id, now, now, run_id, attempt),
            )
            if not cursor.rowcount:
                return
            detail = {"slurm_job_id": job_id, "found_by_name": found_by_name}
            await store.log_decision(db, now, "slurm submitted", detail, run_id=run_id)
            await store.refresh_job(db, run_id, now)

    await store.shielded(work)


async def record_slurm_facts(
    store: Store, run_id: str, attempt: int, facts: SlurmAttemptFacts, now: int
) -> None:
    """Record what slurmrestd said (or that it did not answer) and derive the Job's state."""

    async def work() -> None:
        async with store.transaction() as db:
            await db.execute(
                "UPDATE slurm_attempts SET slurm_state = ?, slurm_reason = ?, reachable = ?, "
                "unreachable_why = ?, has_exit = ?, exit_code = ?, signal = ?, restarts = ?, "
                "updated_at_ms = ? WHERE run_id = ? AND attempt = ?",
                (facts.slurm_state, facts.slurm_reason, int(facts.reachable),
                 facts.unreachable_why, int(facts.has_exit), facts.exit_code, facts.signal,
                 facts.restarts, now, run_id, attempt),
            )  # fmt: skip
            await store.refresh_job(db, run_id, now)

    await store.shielded(work)


async def record_cancel_step(store: Store, run_id: str, attempt: int, step: str, now: int) -> None:
    """Record that a cancel's SIGTERM (``signal``) or Slurm cancel (``cancel``) is being sent:
    written before it is sent, so a restarted coordinator does not send it twice."""
    column = "signalled_at_ms" if step == "signal" else "cancelled_at_ms"

    async def work() -> None:
        async with store.transaction() as db:
            await db.execute(
                f"UPDATE slurm_attempts SET {column} = ?, updated_at_ms = ? "
                "WHERE run_id = ? AND attempt = ?",
                (now, now, run_id, attempt),
            )
            await store.log_decision(db, now, f"slurm {step}", {"attempt": attempt},
                                     run_id=run_id)  # fmt: skip

    await store.shielded(work)


async def slurm_attempt_inputs(
    store: Store, run_id: str, attempt: int
) -> tuple[str, dict[str, str]]:
    """The resolved JobSpec of the Job and the capsule sealed for ``attempt``."""
    row = await first_row(
        store.reader,
        "SELECT p.resolved_json, a.capsule_json FROM jobs j JOIN previews p ON p.id = j.preview_id "
        "JOIN attempts a ON a.run_id = j.run_id WHERE j.run_id = ? AND a.number = ?",
        (run_id, attempt),
    )
    if row is None:
        raise NotFound(f"there is no attempt {attempt} of the Job {run_id!r}.")
    files = json.loads(str(row[1]))
    return str(row[0]), {str(k): str(v) for k, v in dict(files).items()}
