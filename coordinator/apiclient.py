"""The client of the coordinator's ``tuneplane.v1.Api`` service, as ``tp`` uses it.

Rules: TLS with server verification against one CA file, always; every call has a deadline and
carries ``authorization: Bearer <token>``; gRPC, TLS and socket errors are translated here, once,
into :class:`~tuneplane.coordinator.apimodel.ApiError` subclasses whose ``str()`` is a sentence
(the server's own when it refused); messages become :mod:`~tuneplane.coordinator.apimodel` values
here, so nothing above imports betterproto.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import betterproto
from grpclib.client import Channel

from tuneplane.agent.call_failure import CALL_ERRORS, CallFailure, Kind, classify
from tuneplane.agent.client_tls import CaFileError, grpc_client_context
from tuneplane.coordinator.apimodel import (
    ApiError,
    Attempt,
    ClientConfigError,
    CoordinatorUnreachable,
    Endpoint,
    FirstFailure,
    Job,
    Member,
    Preview,
    PreviewSummary,
    Receipt,
    RequestRefused,
    StateChange,
)
from tuneplane.coordinator.fleetmodel import Fleet, Node
from tuneplane.coordinator.fleetwire import fleet_from_wire, node_from_wire
from tuneplane.coordinator.lifecyclemodel import (
    CancelOutcome,
    LogPage,
    LogPiece,
    NodeLossOutcome,
    RetryOutcome,
)
from tuneplane.proto import v1
from tuneplane.proto.contract.derivation_source import ManifestSummary

log = logging.getLogger(__name__)
DEFAULT_TIMEOUT_S = 10.0
T = TypeVar("T")


def _changes(items: list[v1.StateChange]) -> tuple[StateChange, ...]:
    return tuple(StateChange(c.state, c.at_ms, c.reason) for c in items)


def _manifest(msg: v1.OutputManifest | None) -> ManifestSummary | None:
    """A member's output manifest summary; None when its Node reported none (yet): a manifest
    always has a digest or a problem."""
    if msg is None or not (msg.sha256 or msg.problem):
        return None
    return ManifestSummary(msg.files, msg.bytes, msg.sha256, msg.problem)


def job_from_wire(msg: v1.Job) -> Job:
    attempts = []
    for a in msg.attempts:
        members = tuple(
            Member(
                index=m.index,
                node_id=m.node_id,
                state=m.state,
                has_exit=m.has_exit,
                exit_code=m.exit_code,
                signal=m.signal,
                out_dir=m.out_dir,
                gpu_indexes=tuple(m.gpu_indexes),
                history=_changes(m.history),
                ended_at_ms=m.ended_at_ms,
                node_name=m.node_name,
                output_manifest=_manifest(m.output_manifest),
            )
            for m in a.members
        )
        rdv = a.rendezvous
        attempts.append(
            Attempt(
                number=a.number,
                state=a.state,
                members=members,
                master_addr=rdv.master_addr if rdv else "",
                master_port=rdv.master_port if rdv else 0,
                created_at_ms=a.created_at_ms,
            )
        )
    return Job(
        run_id=msg.run_id,
        project=msg.project,
        experiment=msg.experiment,
        owner=msg.owner,
        state=msg.state,
        fleet=msg.fleet,
        profile=msg.profile,
        method_id=msg.method_id,
        preview_id=msg.preview_id,
        digest=msg.digest,
        history=_changes(msg.history),
        attempts=tuple(attempts),
        created_at_ms=msg.created_at_ms,
        init_from=msg.init_from,
        state_reason=msg.state_reason,
        first_failure=_first_failure(msg.first_failure),
    )


def _first_failure(f: v1.FirstFailure) -> FirstFailure | None:
    if not betterproto.serialized_on_wire(f):
        return None
    return FirstFailure(
        attempt=f.attempt,
        member_index=f.member_index,
        node_id=f.node_id,
        state=f.state,
        has_exit=f.has_exit,
        exit_code=f.exit_code,
        signal=f.signal,
        at_ms=f.at_ms,
        what=f.what,
        stderr_tail=f.stderr_tail,
        stderr_cut=f.stderr_cut,
    )


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
        self._channel = Channel(endpoint.host, endpoint.port, ssl=tls_context(endpoint.ca_path))
        self._stub = v1.ApiStub(
            self._channel, metadata={"authorization": f"Bearer {endpoint.token}"}
        )

    async def __aenter__(self) -> ApiClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._channel.close()

    async def preview(self, jobspec_json: str) -> Preview:
        reply = await self._call(
            "Preview", lambda t: self._stub.preview(v1.PreviewRequest(jobspec_json), timeout=t)
        )
        s = reply.summary or v1.PreviewSummary()
        return Preview(
            preview_id=reply.preview_id,
            digest=reply.digest,
            resolved_jobspec_json=reply.resolved_jobspec_json,
            summary=PreviewSummary(
                s.fleet, s.backend, s.series, s.gpus_per_member, s.members, s.profile
            ),
            created_at_ms=reply.created_at_ms,
        )

    async def commit(self, preview_id: str, digest: str, retry_key: str) -> Receipt:
        request = v1.CommitRequest(preview_id=preview_id, digest=digest, retry_key=retry_key)
        r = await self._call("Commit", lambda t: self._stub.commit(request, timeout=t))
        return Receipt(r.run_id, r.preview_id, r.digest, r.retry_key, r.admitted_at_ms, r.created)

    async def get_job(self, run_id: str) -> Job:
        msg = await self._call(
            "GetJob", lambda t: self._stub.get_job(v1.GetJobRequest(run_id), timeout=t)
        )
        return job_from_wire(msg)

    async def list_jobs(
        self, project: str = "", state: str = "", mine: bool = False, limit: int = 0
    ) -> list[Job]:
        request = v1.ListJobsRequest(project=project, state=state, mine=mine, limit=limit)
        reply = await self._call("ListJobs", lambda t: self._stub.list_jobs(request, timeout=t))
        return [job_from_wire(j) for j in reply.jobs]

    async def list_fleets(self) -> list[Fleet]:
        reply = await self._call(
            "ListFleets", lambda t: self._stub.list_fleets(v1.ListFleetsRequest(), timeout=t)
        )
        return [fleet_from_wire(f) for f in reply.fleets]

    async def get_fleet(self, name: str) -> Fleet:
        msg = await self._call(
            "GetFleet", lambda t: self._stub.get_fleet(v1.GetFleetRequest(name), timeout=t)
        )
        return fleet_from_wire(msg)

    async def list_nodes(self, fleet: str = "") -> list[Node]:
        reply = await self._call(
            "ListNodes", lambda t: self._stub.list_nodes(v1.ListNodesRequest(fleet), timeout=t)
        )
        return [node_from_wire(n) for n in reply.nodes]

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
        return NodeLossOutcome(
            node_from_wire(reply.node or v1.Node()),
            tuple(f"{m.run_id}/{m.attempt}/{m.member_index}" for m in reply.lost),
            tuple(job_from_wire(j) for j in reply.jobs),
        )

    async def cancel_job(self, run_id: str, reason: str = "") -> CancelOutcome:
        request = v1.CancelJobRequest(run_id=run_id, reason=reason)
        reply = await self._call("CancelJob", lambda t: self._stub.cancel_job(request, timeout=t))
        return CancelOutcome(reply.outcome, job_from_wire(reply.job or v1.Job()))

    async def retry_job(self, run_id: str) -> RetryOutcome:
        request = v1.RetryJobRequest(run_id=run_id)
        reply = await self._call("RetryJob", lambda t: self._stub.retry_job(request, timeout=t))
        return RetryOutcome(reply.attempt, job_from_wire(reply.job or v1.Job()))

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
        r = await self._call("GetLogs", lambda t: self._stub.get_logs(request, timeout=t))
        return LogPage(
            attempt=r.attempt,
            member_index=r.member_index,
            stream=r.stream,
            pieces=tuple(LogPiece(p.offset, p.data, p.dropped_before) for p in r.pieces),
            next_offset=r.next_offset,
            complete=r.complete,
            dropped_bytes=r.dropped_bytes,
            member_state=r.member_state,
        )

    async def _call(self, name: str, call: Callable[[float], Awaitable[T]]) -> T:
        try:
            return await call(self._timeout_s)
        except CALL_ERRORS as exc:
            raise self._translate(name, classify(exc)) from None

    def _translate(self, name: str, failure: CallFailure) -> ApiError:
        """The one place a failed call becomes an error for the researcher, worded by the table
        every client shares (:mod:`tuneplane.agent.call_failure`)."""
        if failure.status:
            log.debug("api call failed rpc=%s status=%s", name, failure.status)
        if failure.kind is Kind.REFUSED:
            # The coordinator's own sentence, as it wrote it for the researcher.
            return RequestRefused(failure.status, failure.detail or f"{name} was refused.")
        return CoordinatorUnreachable(
            failure.sentence(
                f"the coordinator at {self._endpoint.address}",
                name,
                self._timeout_s,
                self._endpoint.ca_path,
                "Use the CA of that coordinator (its state directory holds tls/ca.pem) with --ca "
                "or --context",
                "that --coordinator or the context file names its API listener",
            )
        )
