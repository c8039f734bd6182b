"""One Job as the researcher API shows it (GetJob, WatchJob): who may ask, and what is sent.

Rules:
- :func:`read_request` is the one check of a request naming a Job: the caller is authenticated
  before the request is read, an empty run id is refused, and reading the Job's state needs
  :func:`~tuneplane.coordinator.job_access.check_read`. GetJob and WatchJob both go through it,
  so they refuse with the same status and sentence.
- :meth:`JobView.shown` is what is sent: the stored Job, its preparing members' image pulls (in
  memory) and, of a failed Job, its first failure with the end of that member's stderr.
"""

from __future__ import annotations

from typing import Any

import attrs
from grpclib import GRPCError
from grpclib.const import Status

from tuneplane.proto import v1

from ..job_access import check_read
from ..lifecycle_failure import TAIL_BYTES, culprit, first_failure
from ..preparations import PreparationBook
from ..store import access as store_access
from ..store.core import Store
from ..store.logs import LogStore
from ..values.jobs import FirstFailure, Job
from .fleet import caller


async def read_request(store: Store, stream: Any) -> v1.GetJobRequest:
    """The call's GetJobRequest once its caller may read that Job's state; else the error
    (AuthError, INVALID_ARGUMENT, NotFound or PermissionDenied) GetJob answers with."""
    user = await caller(store, stream)
    request: v1.GetJobRequest = await stream.recv_message()
    if not request.run_id:
        raise GRPCError(Status.INVALID_ARGUMENT, "GetJobRequest.run_id is empty. Name a run id.")
    check_read(await store_access.job_access(store, request.run_id), user, "state")
    return request


@attrs.define(eq=False)
class JobView:
    """Reads one Job as GetJob sends it."""

    store: Store
    # Where a failed member's stderr is read (its last lines); None: not shown.
    logs: LogStore | None = None
    # Preparing members' image pulls as their Nodes last reported them (in memory).
    preparations: PreparationBook | None = None

    async def shown(self, run_id: str) -> Job:
        job = await self.store.get_job(run_id)
        if self.preparations is not None:
            job = self.preparations.shown(job)
        return attrs.evolve(job, first_failure=await self._first_failure(job))

    async def _first_failure(self, job: Job) -> FirstFailure | None:
        """A failed Job's first failed member, with the end of its stored stderr."""
        found = culprit(job)
        if found is None:
            return None
        data, start = b"", 0
        if self.logs is not None:
            data, start = await self.logs.tail(found.key, "stderr", TAIL_BYTES + 1)
        return first_failure(found, data, start == 0)
