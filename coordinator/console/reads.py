"""What the console reads and changes, through the same store reads and authorization as the
gRPC Api that ``tp`` calls.

Rules:
- Nothing here decides who may do what: authentication is the store's
  :func:`~tuneplane.coordinator.store.identity.authenticate_user`, reading a Job is
  :func:`~tuneplane.coordinator.job_access.check_read`, listing Jobs is
  :func:`~tuneplane.coordinator.store.access.readable_jobs`, and a cancel, a retry and a log
  read are :class:`~tuneplane.coordinator.api.lifecycle.LifecycleApi`'s ``cancel``, ``retry``
  and ``logs``, the ones CancelJob, RetryJob and GetLogs run.
- A Job's decision log is read for who may read the Job, at most :data:`MAX_DECISIONS` rows.
- Metric reads are ListMetrics' and QuerySeries': the same check (``metrics``), the same store
  reads, the same bound on buckets (:data:`~tuneplane.coordinator.api.metrics.MAX_MAX_POINTS`).
- Any signed-in user reads Fleets and Nodes, as with ``tp fleet`` and ``tp node``.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
from grpclib import GRPCError
from grpclib.const import Status

from tuneplane.proto.contract.derivation_source import InitFromSource

from ..api.fleet import FleetService, check_reason
from ..api.lifecycle import LifecycleApi
from ..api.metrics import MAX_MAX_POINTS
from ..clock import now_ms
from ..derivation import stored_source
from ..job_access import check_read
from ..queue_plan import PoolKey
from ..store import access as store_access
from ..store import decision_log
from ..store import identity as store_identity
from ..store.core import Store
from ..store.fleet_views import fleet_views, node_views
from ..store.telemetry import TelemetryStore
from ..values.decisions import DecisionRow
from ..values.fleet import Fleet, Node
from ..values.jobs import JOB_LIST_DEFAULT, JOB_LIST_MAX, Job
from ..values.lifecycle import CancelOutcome, LogPage, RetryOutcome
from ..values.metrics import Delivery, MetricSelector, SeriesResult, TagSummary
from ..values.users import User

#: The most decision-log rows a Job page shows (the newest; the page says when older ones exist).
MAX_DECISIONS = 500


@attrs.frozen
class JobFilter:
    """The Jobs list's filters: empty means any."""

    project: str = ""
    state: str = ""
    owner: str = ""
    limit: int = JOB_LIST_DEFAULT


@attrs.define(eq=False)
class ConsoleReads:
    """The console's window on the store, the telemetry store and the lifecycle calls."""

    store: Store
    telemetry: TelemetryStore
    fleet_service: FleetService
    lifecycle: LifecycleApi
    quotas: Mapping[PoolKey, int]

    async def user(self, token_hash: str) -> User:
        """The user a token (by its stored hash) belongs to now, or :class:`AuthError`."""
        return await store_identity.authenticate_user(self.store, token_hash, now_ms())

    async def fleets(self) -> list[Fleet]:
        return await fleet_views(self.store, self.quotas)

    async def fleet(self, name: str) -> tuple[Fleet, list[Node]]:
        """One Fleet and its Nodes (last heartbeats as this process heard them);
        :class:`NotFound` when there is no such Fleet."""
        (fleet,) = await fleet_views(self.store, self.quotas, name)
        nodes = await node_views(self.store, fleet=name)
        return fleet, [self.fleet_service.live(n) for n in nodes]

    async def jobs(self, user: User, where: JobFilter) -> list[Job]:
        """The newest Jobs ``user`` may read, as ``tp job ls`` lists them."""
        if not 1 <= where.limit <= JOB_LIST_MAX:
            raise GRPCError(
                Status.INVALID_ARGUMENT,
                f"limit is {where.limit}; ask for 1 to {JOB_LIST_MAX} Jobs (the default is "
                f"{JOB_LIST_DEFAULT}) and narrow the list by project, state or owner.",
            )
        return await store_access.readable_jobs(
            self.store, user, where.project, where.state, False, where.limit, owner=where.owner
        )

    async def job(self, user: User, run_id: str) -> Job:
        """One Job with its attempts and members, as ``tp job show`` reads it."""
        check_read(await store_access.job_access(self.store, run_id), user, "state")
        return await self.store.get_job(run_id)

    async def derivation(self, user: User, run_id: str) -> InitFromSource | None:
        """The source the Job's Derivation began from, as its resolved JobSpec carries it (what
        Preview fixed and the digest covers); None for a Job without one."""
        check_read(await store_access.job_access(self.store, run_id), user, "state")
        return stored_source(await self.store.resolved_jobspec(run_id))

    async def delivery(self, user: User, run_id: str) -> list[Delivery]:
        """How far each member's telemetry reached the store, as ``tp metrics`` reads it."""
        check_read(await store_access.job_access(self.store, run_id), user, "metrics")
        return await self.telemetry.delivery(run_id)

    async def cancel(self, user: User, run_id: str, reason: str) -> CancelOutcome:
        """Cancel ``run_id`` as ``user``, by CancelJob's own rules."""
        check_reason(reason, "CancelRequest")
        return await self.lifecycle.cancel(user, run_id, reason)

    async def retry(self, user: User, run_id: str) -> RetryOutcome:
        """Retry ``run_id`` as ``user``, by RetryJob's own rules."""
        return await self.lifecycle.retry(user, run_id)

    async def decisions(self, user: User, run_id: str) -> tuple[list[DecisionRow], bool]:
        """The Job's newest decisions, oldest first, and whether older ones were left out."""
        check_read(await store_access.job_access(self.store, run_id), user, "decisions")
        return await decision_log.job_decisions(self.store, run_id, MAX_DECISIONS)

    async def logs(
        self,
        user: User,
        run_id: str,
        member: tuple[int, int],
        stream: str,
        from_offset: int,
        max_bytes: int,
    ) -> LogPage:
        """A bounded read of member ``member`` = (attempt, index)'s ``stream`` from
        ``from_offset``, as GetLogs reads it (attempt 0: the latest)."""
        return await self.lifecycle.logs(
            user, run_id, member[0], member[1], stream, from_offset, max_bytes, "stream"
        )

    async def tags(self, user: User, run_id: str, attempt: int) -> tuple[int, list[TagSummary]]:
        """The attempt read (0: the latest with points) and its tags, as ListMetrics lists
        them (canonical: every member merged)."""
        check_read(await store_access.job_access(self.store, run_id), user, "metrics")
        return await self.telemetry.list_tags(MetricSelector(run_id, attempt=attempt))

    async def series(
        self,
        user: User,
        run_id: str,
        tag: str,
        attempt: int,
        buckets: int,
        steps: tuple[int, int] | None,
    ) -> SeriesResult:
        """``tag`` of ``run_id`` in at most ``buckets`` buckets, as QuerySeries reads it;
        ``steps`` (first, last) narrows it to a step range, for a zoom."""
        if not tag:
            raise GRPCError(
                Status.INVALID_ARGUMENT,
                "tag is empty. Name a tag (the Charts page lists them; so does `tp metrics "
                f"{run_id}`).",
            )
        if not 1 <= buckets <= MAX_MAX_POINTS:
            raise GRPCError(
                Status.INVALID_ARGUMENT,
                f"buckets is {buckets}; ask for 1 to {MAX_MAX_POINTS}. Buckets keep each "
                "interval's min, max and last, so fewer still show every spike.",
            )
        if steps is not None and steps[0] > steps[1]:
            raise GRPCError(
                Status.INVALID_ARGUMENT,
                f"the step range from {steps[0]} to {steps[1]} is empty; `from` must not exceed "
                "`to`.",
            )
        check_read(await store_access.job_access(self.store, run_id), user, "metrics")
        return await self.telemetry.query_series(
            MetricSelector(run_id, attempt=attempt), tag, buckets, steps
        )
