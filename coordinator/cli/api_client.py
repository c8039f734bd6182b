"""The client of the coordinator's ``tuneplane.v1.Api`` service, as ``tp`` uses it.

Rules: TLS with server verification against one CA file, always; every call has a deadline and
carries ``authorization: Bearer <token>``; gRPC, TLS and socket errors are translated here, once,
into :class:`~.api_errors.ApiError` subclasses whose ``str()`` is a sentence (the server's own
when it refused); replies become :mod:`tuneplane.coordinator.values` through
:mod:`tuneplane.coordinator.wire`, so nothing above imports betterproto.
With several API addresses (coordinators sharing one store) every call follows the leader as
:mod:`.failover` decides, starting with the address that last answered (in this process, or
the one kept in the leader file beside the context file).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import attrs
from grpclib import GRPCError
from grpclib.client import Channel
from grpclib.const import Status

from tuneplane.agent.atomic_file import write_atomic
from tuneplane.agent.call_failure import CALL_ERRORS, CallFailure, Kind, classify
from tuneplane.agent.client_tls import CaFileError, grpc_client_context
from tuneplane.proto import v1

from ..lifecycle import TERMINAL_JOB_STATES
from ..values.fleet import Fleet, Node
from ..values.jobs import Job, Preview, Receipt
from ..values.lifecycle import CancelOutcome, LogPage, NodeLossOutcome, RetryOutcome
from ..wire.fleet import fleet_from_wire, fleets_from_wire, node_from_wire, nodes_from_wire
from ..wire.jobs import job_from_wire, jobs_from_wire, preview_from_wire, receipt_from_wire
from ..wire.lifecycle import cancel_from_wire, logs_from_wire, node_loss_from_wire, retry_from_wire
from . import failover
from .api_errors import (
    ApiError,
    ClientConfigError,
    CoordinatorUnreachable,
    NotServed,
    RequestRefused,
)
from .connection import Endpoint, parse_address

log = logging.getLogger(__name__)
DEFAULT_TIMEOUT_S = 10.0
T = TypeVar("T")
#: The address that last answered, by the list it was one of: tp makes a client for each part
#: of a command, and each should start where the previous one found the leader.
_answered: dict[tuple[str, ...], str] = {}
_ADDRESS_CHECK = "that --coordinator or the context file names its API listener"


#: How grpclib's client reports a grpclib server's "Method not found": that server answers
#: UNIMPLEMENTED in a trailers-only response without a content-type, and the client checks the
#: content-type first. A coordinator older than WatchJob is such a server.
_GRPCLIB_NO_METHOD = (Status.UNKNOWN, "Missing content-type header")


def _not_served(exc: GRPCError) -> bool:
    """Whether ``exc`` says the coordinator has no such method (it is older than this tp)."""
    return exc.status is Status.UNIMPLEMENTED or (exc.status, exc.message) == _GRPCLIB_NO_METHOD


def _failure(exc: BaseException) -> CallFailure:
    """What ``exc`` (one of ``CALL_ERRORS``) says, by the shared table; a socket error is told
    in its errno's words ("Connection refused"), not asyncio's ("Connect call failed (...)")."""
    failure = classify(exc)
    if failure.kind is Kind.UNREACHABLE and isinstance(exc, OSError) and exc.errno:
        return attrs.evolve(failure, detail=os.strerror(exc.errno))
    return failure


# -- the client ------------------------------------------------------------------------------


def tls_context(ca_path: Path) -> ssl.SSLContext:
    """The one client TLS (:mod:`tuneplane.agent.client_tls`); a CA file it cannot load is a
    :class:`ClientConfigError`."""
    try:
        return grpc_client_context(ca_path)
    except CaFileError as exc:
        raise ClientConfigError(str(exc)) from None


class ApiClient:
    """Use as ``async with ApiClient(endpoint) as api: await api.preview(...)``."""

    def __init__(self, endpoint: Endpoint, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._endpoint = endpoint
        self._timeout_s = timeout_s
        self._ssl = tls_context(endpoint.ca_path)
        # One channel (and stub) per address, made when first asked, kept for the next call.
        self._channels: dict[str, tuple[Channel, v1.ApiStub]] = {}
        addresses = endpoint.addresses
        self._address = _answered.get(addresses) or endpoint.last_leader or endpoint.address
        # What the leader file holds (or would, the first address, when it holds nothing).
        self._kept = self._address

    async def __aenter__(self) -> ApiClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for channel, _ in self._channels.values():
            channel.close()

    @property
    def address(self) -> str:
        """The API address that answered the last call (before any call: the one asked first)."""
        return self._address

    @property
    def _stub(self) -> v1.ApiStub:
        """The stub for the address being asked now."""
        return self._open(self._address)[1]

    def _open(self, address: str) -> tuple[Channel, v1.ApiStub]:
        if address not in self._channels:
            host, port = parse_address(address, "--coordinator")
            channel = Channel(host, port, ssl=self._ssl)
            metadata = {"authorization": f"Bearer {self._endpoint.token}"}
            self._channels[address] = (channel, v1.ApiStub(channel, metadata=metadata))
        return self._channels[address]

    async def preview(self, jobspec_json: str) -> Preview:
        reply = await self._call(
            "Preview", lambda t: self._stub.preview(v1.PreviewRequest(jobspec_json), timeout=t)
        )
        return preview_from_wire(reply)

    async def commit(self, preview_id: str, digest: str, retry_key: str) -> Receipt:
        request = v1.CommitRequest(preview_id=preview_id, digest=digest, retry_key=retry_key)
        reply = await self._call("Commit", lambda t: self._stub.commit(request, timeout=t))
        return receipt_from_wire(reply)

    async def get_job(self, run_id: str) -> Job:
        msg = await self._call(
            "GetJob", lambda t: self._stub.get_job(v1.GetJobRequest(run_id), timeout=t)
        )
        return job_from_wire(msg)

    async def watch_job(self, run_id: str) -> AsyncIterator[Job]:
        """``run_id`` as GetJob shows it, then again each time that changed (WatchJob); ends
        after a Job in a terminal state.

        Each stream lasts at most this client's deadline and is opened again when it passes (a
        coordinator that vanished without a word is noticed as a GetJob poll would notice it);
        a stream that breaks is opened again through :meth:`_call`, following the leader. The
        same Job is never yielded twice in a row. :class:`NotServed` when the coordinator has no
        WatchJob (older than this ``tp``): poll :meth:`get_job` instead. Other failures are the
        :class:`ApiError` a GetJob would raise."""
        request = v1.GetJobRequest(run_id)
        last: Job | None = None

        async def open_stream(t: float) -> tuple[AsyncIterator[v1.Job], v1.Job | None]:
            stream = self._stub.watch_job(request, timeout=t)
            try:
                return stream, await anext(stream, None)
            except GRPCError as exc:
                if not _not_served(exc):
                    raise
                # Not one of CALL_ERRORS: :meth:`_call` neither retries it nor asks another
                # coordinator of the store (they run the same version).
                raise NotServed(
                    f"The coordinator at {self._address} does not serve WatchJob (it is older "
                    "than this tp); poll GetJob instead."
                ) from None

        while True:
            stream, message = await self._call("WatchJob", open_stream)
            # Reopened at once after a deadline (a quiet Job); after anything else (a broken
            # stream, or one ended before its Job did) a short pause first, so a stream that
            # keeps breaking is not reopened in a tight loop.
            quiet = False
            try:
                while message is not None:
                    job = job_from_wire(message)
                    if job != last:
                        last = job
                        yield job
                    if job.state in TERMINAL_JOB_STATES:
                        return
                    message = await anext(stream, None)
            except CALL_ERRORS as exc:
                failure = _failure(exc)
                if failure.kind in (Kind.REFUSED, Kind.UNVERIFIED):
                    raise self._translate("WatchJob", failure, self._address) from None
                log.debug(
                    "watch stream ended address=%s kind=%s", self._address, failure.kind.value
                )
                quiet = failure.kind is Kind.TIMED_OUT
            finally:
                await _closed(stream)
            if not quiet:
                await asyncio.sleep(failover.FIRST_PAUSE_S)

    async def list_jobs(
        self, project: str = "", state: str = "", mine: bool = False, limit: int = 0
    ) -> list[Job]:
        request = v1.ListJobsRequest(project=project, state=state, mine=mine, limit=limit)
        reply = await self._call("ListJobs", lambda t: self._stub.list_jobs(request, timeout=t))
        return jobs_from_wire(reply)

    async def list_fleets(self) -> list[Fleet]:
        reply = await self._call(
            "ListFleets", lambda t: self._stub.list_fleets(v1.ListFleetsRequest(), timeout=t)
        )
        return fleets_from_wire(reply)

    async def get_fleet(self, name: str) -> Fleet:
        msg = await self._call(
            "GetFleet", lambda t: self._stub.get_fleet(v1.GetFleetRequest(name), timeout=t)
        )
        return fleet_from_wire(msg)

    async def list_nodes(self, fleet: str = "") -> list[Node]:
        reply = await self._call(
            "ListNodes", lambda t: self._stub.list_nodes(v1.ListNodesRequest(fleet), timeout=t)
        )
        return nodes_from_wire(reply)

    async def get_node(self, node_id: str) -> Node:
        msg = await self._call(
            "GetNode", lambda t: self._stub.get_node(v1.GetNodeRequest(node_id), timeout=t)
        )
        return node_from_wire(msg)

    async def set_node_scheduling(self, node_id: str, scheduling: str, reason: str) -> Node:
        request = v1.SetNodeSchedulingRequest(node_id=node_id, scheduling=scheduling, reason=reason)
        msg = await self._call(
            "SetNodeScheduling", lambda t: self._stub.set_node_scheduling(request, timeout=t)
        )
        return node_from_wire(msg)

    async def revoke_node(self, node_id: str, reason: str) -> Node:
        request = v1.RevokeNodeRequest(node_id=node_id, reason=reason)
        msg = await self._call("RevokeNode", lambda t: self._stub.revoke_node(request, timeout=t))
        return node_from_wire(msg)

    async def set_control_address(self, address: str) -> tuple[str, int]:
        """Tell every Node ``address`` (empty: clear it); returns it and how many connected
        Nodes were told at once."""
        request = v1.SetControlAddressRequest(address=address)
        reply = await self._call(
            "SetControlAddress", lambda t: self._stub.set_control_address(request, timeout=t)
        )
        return reply.address, reply.nodes_told

    async def declare_node_lost(self, node_id: str, reason: str) -> NodeLossOutcome:
        request = v1.DeclareNodeLostRequest(node_id=node_id, reason=reason)
        reply = await self._call(
            "DeclareNodeLost", lambda t: self._stub.declare_node_lost(request, timeout=t)
        )
        return node_loss_from_wire(reply)

    async def cancel_job(self, run_id: str, reason: str = "") -> CancelOutcome:
        request = v1.CancelJobRequest(run_id=run_id, reason=reason)
        reply = await self._call("CancelJob", lambda t: self._stub.cancel_job(request, timeout=t))
        return cancel_from_wire(reply)

    async def retry_job(self, run_id: str) -> RetryOutcome:
        request = v1.RetryJobRequest(run_id=run_id)
        reply = await self._call("RetryJob", lambda t: self._stub.retry_job(request, timeout=t))
        return retry_from_wire(reply)

    async def get_logs(
        self,
        run_id: str,
        member_index: int = 0,
        attempt: int = 0,
        stream: str = "stdout",
        from_offset: int = 0,
        max_bytes: int = 0,
    ) -> LogPage:
        request = v1.GetLogsRequest(
            run_id=run_id,
            attempt=attempt,
            member_index=member_index,
            stream=stream,
            from_offset=from_offset,
            max_bytes=max_bytes,
        )
        reply = await self._call("GetLogs", lambda t: self._stub.get_logs(request, timeout=t))
        return logs_from_wire(reply)

    async def _call(self, name: str, call: Callable[[float], Awaitable[T]]) -> T:
        """Ask the coordinators for ``name`` (``call`` makes the request with a deadline, through
        :attr:`_stub`), following the leader as :class:`~.failover.Attempts` decides."""
        addresses = self._endpoint.addresses
        attempts = failover.Attempts(
            failover.starting_with(addresses, self._address),
            name in failover.RETRY_SAFE,
            time.monotonic(),
            self._endpoint.ride_out_s,
        )
        while True:
            self._address = attempts.address
            reached = False
            try:
                if len(addresses) > 1:
                    # Connect first, on a deadline of its own: a failure here never reached a
                    # coordinator, so even a call that is not safe to repeat goes on.
                    channel = self._open(self._address)[0]
                    deadline = failover.connect_deadline_s(len(addresses), self._timeout_s)
                    await asyncio.wait_for(channel.__connect__(), deadline)
                reached = True
                result = await call(self._timeout_s)
            except CALL_ERRORS as exc:
                failure = _failure(exc)
                step = attempts.failed(failure, reached, time.monotonic(), random.random())
                log.debug(
                    "api call failed rpc=%s address=%s kind=%s status=%s next=%s",
                    name,
                    self._address,
                    failure.kind.value,
                    failure.status,
                    step.address if isinstance(step, failover.Next) else "none",
                )
                if isinstance(step, failover.Stop):
                    raise self._translate(name, step.failure, step.address) from None
                if isinstance(step, failover.GiveUp):
                    check = "that --coordinator or the context file names their API listeners"
                    raise CoordinatorUnreachable(step.sentence(name, check)) from None
                if step.pause_s > 0:
                    await asyncio.sleep(step.pause_s)
            else:
                _answered[addresses] = self._address
                if self._address != self._kept:
                    await self._keep(self._address)
                return result

    async def _keep(self, address: str) -> None:
        """Keep ``address`` in the leader file for the next ``tp``; a failure only costs that
        ``tp`` the refusals of the addresses before the leader."""
        self._kept = address
        path = self._endpoint.leader_file
        if path is None:
            return
        try:
            await asyncio.to_thread(write_atomic, path, f"{address}\n".encode(), 0o644)
        except OSError as exc:
            log.debug("leader not kept path=%s why=%s", path, exc.strerror or exc)

    def _translate(self, name: str, failure: CallFailure, address: str) -> ApiError:
        """The one place a failed call becomes an error for the researcher, worded by the table
        every client shares (:mod:`tuneplane.agent.call_failure`)."""
        if failure.kind is Kind.REFUSED:
            # The coordinator's own sentence, as it wrote it for the researcher.
            return RequestRefused(failure.status, failure.detail or f"{name} was refused.")
        return CoordinatorUnreachable(
            failure.sentence(
                f"the coordinator at {address}",
                name,
                self._timeout_s,
                self._endpoint.ca_path,
                "Use the CA of that coordinator (its state directory holds tls/ca.pem) with --ca "
                "or --context",
                _ADDRESS_CHECK,
            )
        )


async def _closed(stream: AsyncIterator[v1.Job]) -> None:
    """Close a WatchJob stream (cancels its call when it did not end by itself)."""
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()
