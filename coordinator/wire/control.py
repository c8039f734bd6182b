"""The coordinator's wire edge: betterproto messages <-> domain values, typed errors -> gRPC status.

Rules: this is the only coordinator module (with the service handlers) that touches generated
protocol types; everything behind it speaks :mod:`tuneplane.coordinator.records`. Every error a
handler raises leaves through :func:`grpc_errors` as a status code with a sentence.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

import betterproto
from grpclib import GRPCError
from grpclib.const import Status
from grpclib.exceptions import ProtocolError, StreamTerminatedError

from tuneplane.coordinator import capsule
from tuneplane.coordinator.auth import AuthError, PermissionDenied
from tuneplane.coordinator.config import ConfigError
from tuneplane.coordinator.lifecycle_failure import FirstFailure
from tuneplane.coordinator.records import (
    AbortOrder,
    CancelOrder,
    CommitOrder,
    GpuInfo,
    HeldMember,
    InventoryInfo,
    JobView,
    MemberKey,
    Order,
    OutputsService,
    PrepareOrder,
    Report,
    StateChangeRecord,
)
from tuneplane.coordinator.store import Conflict, EnrollRefused, NotFound
from tuneplane.proto import v1
from tuneplane.proto.contract.derivation_source import ManifestSummary
from tuneplane.proto.contract.input_checks import InputRefused
from tuneplane.proto.contract.jobspec import JobSpecError

log = logging.getLogger(__name__)

_STATE_NAMES: dict[int, str] = {
    v1.MemberState.PREPARING: "preparing",
    v1.MemberState.PREPARED: "prepared",
    v1.MemberState.COMMITTED: "committed",
    v1.MemberState.STARTING: "starting",
    v1.MemberState.RUNNING: "running",
    v1.MemberState.EXITED: "exited",
    v1.MemberState.ABORTED: "aborted",
    v1.MemberState.CANCELLING: "cancelling",
    v1.MemberState.LOST: "lost",
}


class BadMessage(ValueError):
    """A message from a Node that the protocol does not allow (gRPC INVALID_ARGUMENT)."""


def member_state_name(state: v1.MemberState | int) -> str:
    try:
        return _STATE_NAMES[int(state)]
    except KeyError:
        raise BadMessage(
            f"member state {int(state)} is not one a Node may report. Upgrade the Node."
        ) from None


def member_key(ref: v1.MemberRef | None) -> MemberKey:
    if ref is None or not ref.run_id:
        raise BadMessage("the message names no member (member.run_id is empty).")
    return MemberKey(ref.run_id, ref.attempt, ref.member_index)


def member_ref(key: MemberKey) -> v1.MemberRef:
    return v1.MemberRef(run_id=key.run_id, attempt=key.attempt, member_index=key.member_index)


def inventory(inv: v1.Inventory | None, hostname: str = "") -> InventoryInfo:
    if inv is None:
        return InventoryInfo(hostname=hostname)
    return InventoryInfo(
        hostname=inv.hostname or hostname,
        gpus=tuple(
            GpuInfo(
                index=g.index,
                series=g.series,
                healthy=g.healthy,
                uuid=g.uuid,
                name=g.name,
                memory_bytes=g.memory_bytes,
                mig_enabled=g.mig_enabled,
                health_reason=g.health_reason,
            )
            for g in inv.gpus
        ),
        gpu_source=inv.gpu_source or "none",
        cpu_count=inv.cpu_count,
        memory_bytes=inv.memory_bytes,
        driver_version=inv.driver_version,
        cuda_version=inv.cuda_version,
    )


def held_members(hello: v1.Hello) -> list[HeldMember]:
    held = []
    for h in hello.held:
        try:
            held.append(HeldMember(member_key(h.member), member_state_name(h.state)))
        except BadMessage:
            log.warning("hello names a held member the coordinator cannot read; skipping it")
    return held


def outputs_service(hello: v1.Hello) -> OutputsService | None:
    """What Hello.outputs says, unchecked (:func:`.outputs_grants.check_service` judges it);
    None when the Node serves no outputs (unset, or an empty address)."""
    msg = hello.outputs
    if not betterproto.serialized_on_wire(msg) or not msg.address:
        return None
    return OutputsService(msg.address, msg.cert_sha256, bytes(msg.grant_key))


def report(msg: v1.MemberReport) -> Report:
    return Report(
        report_seq=msg.report_seq,
        member=member_key(msg.member),
        state=member_state_name(msg.state),
        at_ms=msg.at_ms,
        reason=msg.reason,
        has_exit=msg.has_exit,
        exit_code=msg.exit_code,
        signal=msg.signal,
        out_dir=msg.out_dir,
        journal_id=msg.journal_id,
        manifest=manifest_from_wire(msg.output_manifest),
    )


def order_message(order: Order) -> v1.CoordinatorMessage:
    """The CoordinatorMessage that carries ``order`` to its Node."""
    ref = member_ref(order.member)
    if isinstance(order, PrepareOrder):
        prepare = v1.CoordinatorMessage(
            prepare=v1.Prepare(
                member=ref,
                jobspec_json=order.jobspec_json,
                member_count=order.member_count,
                gpu_indexes=list(order.gpu_indexes),
                pick_rendezvous=order.pick_rendezvous,
                capsule_digests=capsule.digests(order.capsule_files),
                capsule_files={k: v.encode("utf-8") for k, v in order.capsule_files.items()},
                owner=order.owner,
                gpu_uuids=list(order.gpu_uuids),
                rendezvous_nonce=order.rendezvous_nonce,
            )
        )
        if order.master_port:
            prepare.prepare.rendezvous = v1.Rendezvous(
                master_addr=order.master_addr, master_port=order.master_port
            )
        fetch = order.init_from_fetch
        if fetch is not None:
            prepare.prepare.init_from_fetch = v1.InitFromFetch(
                address=fetch.address,
                cert_sha256=fetch.cert_sha256,
                grant=fetch.grant,
                grant_expires_at_ms=fetch.grant_expires_at_ms,
            )
        return prepare
    if isinstance(order, CommitOrder):
        return v1.CoordinatorMessage(
            commit=v1.Commit(
                member=ref,
                rendezvous=v1.Rendezvous(
                    master_addr=order.master_addr, master_port=order.master_port
                ),
                collector_credential=order.collector_credential,
                telemetry_address=order.telemetry_address,
            )
        )
    if isinstance(order, AbortOrder):
        return v1.CoordinatorMessage(abort=v1.Abort(member=ref, reason=order.reason))
    if isinstance(order, CancelOrder):
        return v1.CoordinatorMessage(
            cancel=v1.Cancel(
                member=ref,
                reason=order.reason,
                grace_period_s=order.grace_period_s,
                declared_lost=order.declared_lost,
            )
        )
    raise TypeError(f"not an order: {order!r}")


def _changes(history: tuple[StateChangeRecord, ...]) -> list[v1.StateChange]:
    return [v1.StateChange(state=h.state, at_ms=h.at_ms, reason=h.reason) for h in history]


def job_message(job: JobView) -> v1.Job:
    return v1.Job(
        run_id=job.run_id,
        project=job.project,
        experiment=job.experiment,
        owner=job.owner,
        state=job.state,
        fleet=job.fleet,
        profile=job.profile,
        method_id=job.method_id,
        preview_id=job.preview_id,
        digest=job.digest,
        history=_changes(job.history),
        attempts=[
            v1.Attempt(
                number=a.number,
                state=a.state,
                rendezvous=v1.Rendezvous(master_addr=a.master_addr, master_port=a.master_port),
                created_at_ms=a.created_at_ms,
                members=[
                    v1.Member(
                        index=m.index,
                        node_id=m.node_id,
                        state=m.state,
                        has_exit=m.has_exit,
                        exit_code=m.exit_code,
                        signal=m.signal,
                        out_dir=m.out_dir,
                        gpu_indexes=list(m.gpu_indexes),
                        history=_changes(m.history),
                        ended_at_ms=m.ended_at_ms,
                        node_name=m.node_name,
                        output_manifest=manifest_to_wire(m.output_manifest),
                    )
                    for m in a.members
                ],
            )
            for a in job.attempts
        ],
        created_at_ms=job.created_at_ms,
        init_from=job.init_from,
        state_reason=job.state_reason,
    )


def first_failure_message(failed: FirstFailure) -> v1.FirstFailure:
    m = failed.member
    return v1.FirstFailure(
        attempt=failed.attempt,
        member_index=m.index,
        node_id=m.node_id,
        state=m.state,
        has_exit=m.has_exit,
        exit_code=m.exit_code,
        signal=m.signal,
        at_ms=failed.at_ms,
        what=failed.what,
        stderr_tail=failed.stderr_tail,
        stderr_cut=failed.stderr_cut,
    )


_PASSED_THROUGH = (GRPCError, StreamTerminatedError, ProtocolError)


def _only_grpc_error(group: BaseExceptionGroup[BaseException]) -> Exception | None:
    """A task group's failure that is only a chosen status or a peer that went away (a
    session's refusal, a Node that dropped): its first such error, else None."""
    leaves: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending:
        exc = pending.pop()
        if isinstance(exc, BaseExceptionGroup):
            pending.extend(exc.exceptions)
        else:
            leaves.append(exc)
    if leaves and all(isinstance(leaf, _PASSED_THROUGH) for leaf in leaves):
        grpc = [leaf for leaf in leaves if isinstance(leaf, GRPCError)]
        first = (grpc or leaves)[0]
        assert isinstance(first, Exception)
        return first
    return None


@contextmanager
def grpc_errors() -> Iterator[None]:
    """Translate the coordinator's typed errors into gRPC status codes, once, at the edge.

    This is the one translator: every handler of every listener runs inside it (the listeners
    wrap each handler, :mod:`~tuneplane.coordinator.message_limits`). An exception nobody
    expected becomes INTERNAL with an error id that is also in the log, and the process keeps
    serving.
    """
    try:
        yield
    except _PASSED_THROUGH:
        # A status already chosen, or a peer that went away: grpclib handles both.
        raise
    except AuthError as exc:
        raise GRPCError(Status.UNAUTHENTICATED, str(exc)) from None
    except (PermissionDenied, EnrollRefused) as exc:
        raise GRPCError(Status.PERMISSION_DENIED, str(exc)) from None
    except JobSpecError as exc:
        raise GRPCError(Status.INVALID_ARGUMENT, str(exc)) from None
    except BadMessage as exc:
        raise GRPCError(Status.INVALID_ARGUMENT, str(exc)) from None
    except NotFound as exc:
        raise GRPCError(Status.NOT_FOUND, str(exc)) from None
    except Conflict as exc:
        raise GRPCError(Status.FAILED_PRECONDITION, str(exc)) from None
    except ConfigError as exc:
        raise GRPCError(Status.FAILED_PRECONDITION, str(exc)) from None
    except InputRefused as exc:
        raise GRPCError(Status.INVALID_ARGUMENT, str(exc)) from None
    except Exception as exc:
        single = _only_grpc_error(exc) if isinstance(exc, BaseExceptionGroup) else None
        if single is not None:
            raise single from None
        error_id = secrets.token_hex(6)
        log.exception("unexpected error in a call error_id=%s", error_id)
        raise GRPCError(
            Status.INTERNAL,
            f"The coordinator failed unexpectedly (error id {error_id}) and keeps serving. "
            "Tell the coordinator's operator the error id; its log holds the details.",
        ) from None


def manifest_from_wire(msg: v1.OutputManifest | None) -> ManifestSummary | None:
    """A MemberReport's ``output_manifest``; None when the report carries none (a manifest
    always has a digest or a problem)."""
    if msg is None or not (msg.sha256 or msg.problem):
        return None
    return ManifestSummary(msg.files, msg.bytes, msg.sha256, msg.problem)


def manifest_to_wire(summary: ManifestSummary | None) -> v1.OutputManifest:
    """A member's output manifest for GetJob; empty when its Node reported none."""
    if summary is None:
        return v1.OutputManifest()
    return v1.OutputManifest(
        files=summary.files, bytes=summary.bytes, sha256=summary.sha256, problem=summary.problem
    )
