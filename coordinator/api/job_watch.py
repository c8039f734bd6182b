"""WatchJob: one Job sent as GetJob shows it, then again each time that changed, until it ends.

Rules:
- The request is checked as GetJob checks it (:func:`~.job_view.read_request`), so a refusal has
  the same status and sentence, and nothing is watched before it passed.
- A message is sent only when it differs from the last one sent. After a Job in a terminal state
  the stream ends (OK).
- Between reads the watch waits for the store to say the Job changed (:mod:`..job_changes`,
  told after the commit) or for the fallback interval: image-pull progress lives in memory, and
  no transaction tells of it.
- The watch leaves the book however the stream ends (done, client gone, deadline passed).
"""

from __future__ import annotations

import logging
from typing import Any

from grpclib.const import Cardinality, Handler

from tuneplane.proto import v1

from .. import lifecycle
from ..gateways.message_limits import pre_encoded
from ..gateways.status import grpc_errors
from ..job_changes import DEFAULT_FALLBACK_S, JobChanges
from ..store.core import Store
from ..wire.jobs import job_to_wire
from .job_view import JobView, read_request

log = logging.getLogger(__name__)


class JobWatchApi:
    """The grpclib handler of ``tuneplane.v1.Api/WatchJob``."""

    def __init__(
        self,
        store: Store,
        view: JobView,
        changes: JobChanges,
        fallback_s: float = DEFAULT_FALLBACK_S,
    ) -> None:
        self._store = store
        self._view = view
        self._changes = changes
        self._fallback_s = fallback_s

    def __mapping__(self) -> dict[str, Handler]:
        return {
            "/tuneplane.v1.Api/WatchJob": Handler(
                self._watch_job, Cardinality.UNARY_STREAM, v1.GetJobRequest, v1.Job
            ),
        }

    async def _watch_job(self, stream: Any) -> None:
        with grpc_errors():
            run_id = (await read_request(self._store, stream)).run_id
            sent, last = 0, b""
            with self._changes.watching(run_id) as watch:
                while True:
                    # Armed before the read: a change committed after it still wakes the wait.
                    watch.arm()
                    job = await self._view.shown(run_id)
                    message = job_to_wire(job)
                    data = bytes(message)
                    if data != last:
                        await stream.send_message(pre_encoded(message, data))
                        sent, last = sent + 1, data
                    if job.state in lifecycle.TERMINAL_JOB_STATES:
                        log.info("job watch ended run_id=%s state=%s sent=%d",
                                 run_id, job.state, sent)  # fmt: skip
                        return
                    await watch.wait(self._fallback_s)
