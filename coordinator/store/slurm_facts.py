"""The Slurm facts of one attempt, read inside a transaction (for ``refresh_job``) or from a
row of the executor's read: one converter for the ``slurm_attempts`` columns they share."""

from __future__ import annotations

from collections.abc import Sequence

from ..slurm_attempt import SlurmAttemptFacts
from .handle import Handle, first_row

COLUMNS = (
    "slurm_job_id, slurm_state, slurm_reason, reachable, unreachable_why, has_exit, exit_code, "
    "signal, restarts"
)


def facts_of(row: Sequence[object]) -> SlurmAttemptFacts:
    """The facts in ``row``, whose values are :data:`COLUMNS` in order."""
    job_id, state, reason, reachable, why, has_exit, code, sig, restarts = row
    return SlurmAttemptFacts(
        job_id=None if job_id is None else int(str(job_id)), slurm_state=str(state),
        slurm_reason=str(reason), reachable=bool(reachable), unreachable_why=str(why),
        has_exit=bool(has_exit), exit_code=int(str(code)), signal=int(str(sig)),
        restarts=int(str(restarts)),
    )  # fmt: skip


async def slurm_facts(db: Handle, run_id: str, attempt: int) -> SlurmAttemptFacts | None:
    """The Slurm facts of an attempt; None for an attempt that runs on Nodes."""
    row = await first_row(
        db,
        f"SELECT {COLUMNS} FROM slurm_attempts WHERE run_id = ? AND attempt = ?",
        (run_id, attempt),
    )
    return None if row is None else facts_of(tuple(row))
