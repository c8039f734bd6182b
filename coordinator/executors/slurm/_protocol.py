"""The one interface the coordinator uses to drive Slurm: what any slurmrestd version must do.

Rules: each OpenAPI version implements this in its own module (only :mod:`._v0038` today); code
above this interface never sees a version's paths or JSON. Every method is a checkpoint and
raises only :class:`~._errors.SlurmError` subclasses.
"""

from __future__ import annotations

from typing import Protocol

from ._values import JobRequest, SlurmJob, SlurmNode


class SlurmRest(Protocol):
    """A connection to one slurmrestd, speaking one OpenAPI version."""

    @property
    def version(self) -> str:
        """The OpenAPI version this speaks, e.g. ``v0.0.38``."""
        ...

    async def ping(self) -> None:
        """Return when slurmrestd answers and slurmctld is up; raise otherwise."""
        ...

    async def submit(self, request: JobRequest) -> int:
        """Submit a batch job; its Slurm job id."""
        ...

    async def job(self, job_id: int) -> SlurmJob:
        """The job's state now; :class:`~._errors.SlurmJobNotFound` when Slurm does not know it."""
        ...

    async def jobs(self) -> list[SlurmJob]:
        """Every job slurmctld still holds (one request, however many there are)."""
        ...

    async def jobs_named(self, name: str) -> list[SlurmJob]:
        """Every job slurmctld still holds whose name is ``name``, oldest first."""
        ...

    async def cancel(self, job_id: int) -> None:
        """Cancel the job as ``scancel`` does: SIGTERM to its processes, SIGKILL after the
        cluster's KillWait; it ends CANCELLED."""
        ...

    async def signal(self, job_id: int, signal: int) -> None:
        """Send ``signal`` to the job's processes without cancelling it: a script that dies of
        it ends FAILED (the Job's own grace period is a SIGTERM here, then :meth:`cancel`)."""
        ...

    async def partition_nodes(self, partition: str) -> list[SlurmNode]:
        """The nodes of ``partition`` with their GPUs; :class:`~._errors.SlurmRefused` when
        there is no such partition."""
        ...

    async def aclose(self) -> None:
        """Close the HTTP connections."""
        ...
