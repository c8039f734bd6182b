"""The Api's Job lifecycle calls: CancelJob, RetryJob and GetLogs.

Rules:
- Served on the API listener beside :class:`~tuneplane.coordinator.api.jobs.ApiService`; every
  call is authenticated from its user token before the request is read. Only a Job's owner or
  an admin may cancel or retry it; its logs are read by those who may read the Job
  (:mod:`~tuneplane.coordinator.job_access`: owner, the users its project shares it with, admins).
- A cancel is on disk (:mod:`~tuneplane.coordinator.store.lifecycle`) before its orders go to
  the Nodes; an order for a disconnected Node waits in the store for its next Hello.
- GetLogs is bounded (at most :data:`MAX_LOG_BYTES` per call) and never waits: ``tp logs
  --follow`` polls with the returned offset until the reply says the stream is complete.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from grpclib import GRPCError
from grpclib.const import Cardinality, Handler, Status

from tuneplane.proto import v1

from ..clock import now_ms
from ..gateways.sessions import SessionRegistry
from ..gateways.status import grpc_errors
from ..job_access import check_read
from ..store import lifecycle as store_lifecycle
from ..store.access import job_access
from ..store.core import Store
from ..store.logs import BadStream, LogStore, check_stream
from ..values.lifecycle import (
    CANCELLED,
    CancelOutcome,
    LogPage,
    RetryOutcome,
)
from ..values.users import User
from ..wire.lifecycle import cancel_to_wire, logs_to_wire, retry_to_wire
from .fleet import caller, check_reason

log = logging.getLogger(__name__)

MAX_LOG_BYTES = 1024 * 1024


class LifecycleApi:
    """grpclib handlers for cancel, retry and logs on ``tuneplane.v1.Api``."""

    def __init__(
        self,
        store: Store,
        logs: LogStore,
        registry: SessionRegistry,
        wake_scheduler: Callable[[], None],
    ) -> None:
        self._store = store
        self._logs = logs
        self._registry = registry
        self._wake = wake_scheduler

    def __mapping__(self) -> dict[str, Handler]:
        return {
            "/tuneplane.v1.Api/CancelJob": Handler(
                self._cancel, Cardinality.UNARY_UNARY, v1.CancelJobRequest, v1.CancelJobReply
            ),
            "/tuneplane.v1.Api/RetryJob": Handler(
                self._retry, Cardinality.UNARY_UNARY, v1.RetryJobRequest, v1.RetryJobReply
            ),
            "/tuneplane.v1.Api/GetLogs": Handler(
                self._get_logs, Cardinality.UNARY_UNARY, v1.GetLogsRequest, v1.GetLogsReply
            ),
        }

    async def _cancel(self, stream: Any) -> None:
        with grpc_errors():
            user = await caller(self._store, stream)
            request: v1.CancelJobRequest = await stream.recv_message()
            _require_run_id(request.run_id, "CancelJobRequest")
            check_reason(request.reason, "CancelJobRequest")
            outcome = await self.cancel(user, request.run_id, request.reason)
            await stream.send_message(cancel_to_wire(outcome))

    async def cancel(self, user: User, run_id: str, reason: str) -> CancelOutcome:
        """Cancel ``run_id`` as ``user`` (its owner or an admin, decided by the store in the
        cancel's own transaction) and send the orders that carry it out: CancelJob and the
        console's cancel both come here, so both follow the same rules."""
        result = await store_lifecycle.cancel_job(
            self._store, run_id, user.name, user.is_admin, reason.strip(), now_ms()
        )
        log.info(
            "job cancel run_id=%s by=%s outcome=%s orders=%d",
            run_id,
            user.name,
            result.outcome,
            len(result.orders),
        )
        self._registry.dispatch(list(result.orders))
        if result.outcome == CANCELLED:
            # GPUs went back (an aborted launch): queued Jobs may fit now.
            self._wake()
        return CancelOutcome(result.outcome, await self._store.get_job(run_id))

    async def _retry(self, stream: Any) -> None:
        with grpc_errors():
            user = await caller(self._store, stream)
            request: v1.RetryJobRequest = await stream.recv_message()
            _require_run_id(request.run_id, "RetryJobRequest")
            await stream.send_message(retry_to_wire(await self.retry(user, request.run_id)))

    async def retry(self, user: User, run_id: str) -> RetryOutcome:
        """Queue ``run_id`` again as ``user`` (its owner or an admin, decided by the store in
        the retry's own transaction): RetryJob and the console's retry both come here."""
        number = await store_lifecycle.retry_job(
            self._store, run_id, user.name, user.is_admin, now_ms()
        )
        self._wake()
        return RetryOutcome(number, await self._store.get_job(run_id))

    async def _get_logs(self, stream: Any) -> None:
        with grpc_errors():
            user = await caller(self._store, stream)
            request: v1.GetLogsRequest = await stream.recv_message()
            _require_run_id(request.run_id, "GetLogsRequest")
            page = await self.logs(
                user,
                request.run_id,
                request.attempt,
                request.member_index,
                request.stream or "stdout",
                request.from_offset,
                request.max_bytes,
                "GetLogsRequest.stream",
            )
            await stream.send_message(logs_to_wire(page))

    async def logs(
        self,
        user: User,
        run_id: str,
        attempt: int,
        member_index: int,
        stream_name: str,
        from_offset: int,
        max_bytes: int,
        field: str,
    ) -> LogPage:
        """One bounded read of a member's log (attempt 0: the latest) for who may read the Job:
        GetLogs and the console's logs both come here. ``max_bytes`` 0 or past
        :data:`MAX_LOG_BYTES` reads :data:`MAX_LOG_BYTES`; ``field`` names the stream's field
        in a refusal."""
        check_read(await job_access(self._store, run_id), user, "logs")
        try:
            name = check_stream(stream_name)
        except BadStream as exc:
            raise GRPCError(Status.INVALID_ARGUMENT, f"{field}: {exc}") from None
        member, state = await self._store.member_for_logs(run_id, attempt, member_index)
        read_bytes = min(max_bytes or MAX_LOG_BYTES, MAX_LOG_BYTES)
        read = await self._logs.read(member, name, from_offset, read_bytes)
        return LogPage(
            attempt=member.attempt,
            member_index=member.member_index,
            stream=name,
            pieces=read.pieces,
            next_offset=read.next_offset,
            complete=read.complete,
            dropped_bytes=read.dropped_bytes,
            member_state=state,
        )


def _require_run_id(run_id: str, message: str) -> None:
    if not run_id:
        raise GRPCError(Status.INVALID_ARGUMENT, f"{message}.run_id is empty. Name a run id.")
