"""Values that cross the :class:`SlurmRest` interface, independent of any OpenAPI version.

Rules: frozen attrs classes; nothing here knows HTTP or a version's JSON field names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs


@attrs.frozen
class ExitStatus:
    """How a Slurm job's batch script ended: an exit code, or the signal that ended it."""

    code: int
    signal: int | None = None


@attrs.frozen
class JobRequest:
    """One batch job to submit.

    ``name`` is the idempotency key: it carries the attempt id, so a coordinator that crashed
    between submitting and recording the Slurm job id finds the job by name instead of
    submitting a second one."""

    name: str
    partition: str
    script: str
    working_directory: str
    nodes: int = 1
    gpus_per_node: int = 0
    gpu_type: str = ""  # the gpu GRES type asked for ("": any)
    constraint: str = ""  # a node feature every node must have ("": none)
    environment: Mapping[str, str] = attrs.field(factory=dict)
    standard_output: str = "/dev/null"
    standard_error: str | None = None
    time_limit_minutes: int | None = None


@attrs.frozen
class SlurmJob:
    """What slurmctld reports about one job."""

    job_id: int
    name: str
    slurm_state: str  # Slurm's word, e.g. ``RUNNING``; map it with :func:`job_state`
    reason: str  # Slurm's state_reason (``None`` as Slurm writes it when there is none)
    exit: ExitStatus | None  # None until the job has ended
    nodes: str  # Slurm's host list expression of the allocation ("" while pending)
    restarts: int = 0  # how many times Slurm requeued it (restart_cnt)


def jobs_named(jobs: Sequence[SlurmJob], name: str) -> list[SlurmJob]:
    """The jobs in ``jobs`` named ``name``, oldest first."""
    return sorted((j for j in jobs if j.name == name), key=lambda j: j.job_id)


@attrs.frozen
class SlurmNode:
    """One node of a partition as slurmctld reports it."""

    name: str
    state: str  # Slurm's node state, lower case as slurmrestd writes it (``idle``, ``mixed``)
    partitions: tuple[str, ...]
    cpus: int
    gpus: int  # GPUs in its ``gres`` (0 when it has none)
    gpus_used: int
    gres: str  # Slurm's own text, e.g. ``gpu:h100:8(S:0-1)``
