"""Conversion between the agent's messages (agent/messages.py) and the generated protobuf classes.

Part of the agent's adapter layer (with :mod:`.adapter`, :mod:`.wire` and :mod:`.wire_control`):
betterproto messages are converted to attrs domain objects here, at the wire edge, and domain
code never sees a protobuf class.

Rules: a message this agent does not know, or one carrying a field of the wrong type, a NUL or a
lone surrogate, is an :class:`~.wire.UnknownMessage` whose ``str()`` says what to do.
"""

from __future__ import annotations

import betterproto

from tuneplane.proto import v1
from tuneplane.proto.contract.derivation_source import ManifestSummary
from tuneplane.proto.contract.input_checks import InputRefused, check_message

from . import messages as m
from .inventory import Gpu, Inventory
from .journal_records import MemberKey
from .member_state import MemberState
from .wire import UnknownMessage


def inventory_to_wire(inv: Inventory) -> v1.Inventory:
    return v1.Inventory(
        hostname=inv.hostname,
        cpu_count=inv.cpu_count,
        memory_bytes=inv.memory_bytes,
        gpus=[
            v1.Gpu(
                index=g.index,
                uuid=g.uuid,
                name=g.name,
                series=g.series,
                memory_bytes=g.memory_bytes,
                mig_enabled=g.mig_enabled,
                healthy=g.healthy,
                health_reason=g.health_reason,
            )
            for g in inv.gpus
        ],
        gpu_source=inv.gpu_source,
        driver_version=inv.driver_version,
        cuda_version=inv.cuda_version,
    )


def inventory_from_wire(inv: v1.Inventory) -> Inventory:
    gpus = tuple(
        Gpu(g.index, g.uuid, g.name, g.series, g.memory_bytes, g.mig_enabled, g.healthy,
            g.health_reason)
        for g in inv.gpus
    )  # fmt: skip
    return Inventory(
        inv.hostname, inv.cpu_count, inv.memory_bytes, gpus, inv.gpu_source,
        inv.driver_version, inv.cuda_version,
    )  # fmt: skip


def _ref(key: MemberKey) -> v1.MemberRef:
    return v1.MemberRef(run_id=key.run_id, attempt=key.attempt, member_index=key.member_index)


def _key(ref: v1.MemberRef) -> MemberKey:
    return MemberKey(ref.run_id, ref.attempt, ref.member_index)


def _state(state: MemberState) -> v1.MemberState:
    wire_state: v1.MemberState = v1.MemberState[state.name]
    return wire_state


def _rendezvous(r: v1.Rendezvous | None) -> m.Rendezvous | None:
    if r is None or not r.master_port:
        return None
    return m.Rendezvous(r.master_addr, r.master_port)


def _init_from_fetch(f: v1.InitFromFetch | None) -> m.InitFromFetch | None:
    if f is None or not f.address:
        return None
    return m.InitFromFetch(f.address, f.cert_sha256, f.grant, f.grant_expires_at_ms)


def to_wire(msg: m.Outgoing) -> v1.NodeMessage:
    """One outgoing domain message as the NodeMessage that carries it."""
    if isinstance(msg, m.Hello):
        held = [v1.HeldMember(member=_ref(k), state=_state(s)) for k, s in msg.held]
        hello = v1.NodeMessage(
            hello=v1.Hello(
                node_id=msg.node_id,
                agent_version=msg.agent_version,
                inventory=inventory_to_wire(msg.inventory),
                held=held,
                dialed_address=msg.dialed_address,
                protocol=msg.protocol,
                capabilities=list(msg.capabilities),
            )
        )
        if msg.outputs is not None:
            hello.hello.outputs = v1.OutputsService(
                address=msg.outputs.address,
                cert_sha256=msg.outputs.cert_sha256,
                grant_key=msg.outputs.grant_key,
            )
        return hello
    if isinstance(msg, m.Heartbeat):
        beat = v1.Heartbeat(seq=msg.seq, sent_at_ms=msg.sent_at_ms)
        if msg.inventory is not None:
            beat.inventory = inventory_to_wire(msg.inventory)
        return v1.NodeMessage(heartbeat=beat)
    if isinstance(msg, m.Report):
        r = msg.report
        exit = r.exit
        return v1.NodeMessage(
            report=v1.MemberReport(
                report_seq=r.report_seq,
                member=_ref(r.key),
                state=_state(r.state),
                at_ms=r.at_ms,
                reason=r.reason,
                has_exit=exit is not None,
                exit_code=(exit.exit_code or 0) if exit else 0,
                signal=(exit.signal or 0) if exit else 0,
                out_dir=r.out_dir,
                journal_id=r.journal_id,
                output_manifest=_manifest(r.manifest),
            )
        )
    if isinstance(msg, m.PrepareReply):
        reply = v1.PrepareReply(
            member=_ref(msg.key), ok=msg.ok, reason=msg.reason, rendezvous_held=msg.rendezvous_held
        )
        if msg.rendezvous is not None:
            reply.rendezvous = v1.Rendezvous(
                master_addr=msg.rendezvous.master_addr, master_port=msg.rendezvous.master_port
            )
        return v1.NodeMessage(prepare_reply=reply)
    if isinstance(msg, m.PrepareProgress):
        return v1.NodeMessage(
            prepare_progress=v1.PrepareProgress(
                member=_ref(msg.key),
                image=msg.image,
                bytes_done=msg.bytes_done,
                bytes_total=msg.bytes_total,
                layers_done=msg.layers_done,
                layers_total=msg.layers_total,
                phase=msg.phase,
            )
        )
    if isinstance(msg, m.LogChunk):
        return v1.NodeMessage(
            log_chunk=v1.LogChunk(
                member=_ref(msg.key),
                stream=msg.stream,
                offset=msg.offset,
                data=msg.data,
                eof=msg.eof,
            )
        )
    if isinstance(msg, m.CredentialRenewal):
        return v1.NodeMessage(credential_renewal=v1.CredentialRenewal(request_id=msg.request_id))
    if isinstance(msg, m.CredentialStored):
        return v1.NodeMessage(credential_stored=v1.CredentialStored(request_id=msg.request_id))
    return v1.NodeMessage(decision_query=v1.DecisionQuery(member=_ref(msg.key)))


def _refuse_bad_text(msg: v1.CoordinatorMessage, body: object) -> None:
    """A field of the wrong type, or a NUL or lone surrogate in a string, is refused here.

    A Prepare's file names and JobSpec are Prepare's own to refuse (its PrepareReply says why
    and the Job is aborted); only the member it names must be usable to answer at all.
    """
    try:
        if isinstance(body, v1.Prepare):
            check_message(msg, text=False)
            check_message(body.member)
        else:
            check_message(msg)
    except InputRefused as exc:
        raise UnknownMessage(
            f"The coordinator sent a message this agent cannot use: {exc} The message is skipped."
        ) from None


def from_wire(msg: v1.CoordinatorMessage) -> m.Incoming:
    """The domain message carried by one CoordinatorMessage; :class:`UnknownMessage` if none."""
    name, body = betterproto.which_one_of(msg, "body")
    _refuse_bad_text(msg, body)
    if isinstance(body, v1.Welcome):
        return m.Welcome(
            body.heartbeat_interval_ms,
            body.heartbeat_timeout_ms,
            body.server_time_ms,
            body.credential_issued_at_ms,
            body.credential_expires_at_ms,
            body.control_address,
            tuple(body.coordinators),
            body.coordinator_version,
            body.protocol,
            tuple(body.capabilities),
        )
    if isinstance(body, v1.ControlAddress):
        return m.ControlAddress(body.address)
    if isinstance(body, v1.Coordinators):
        return m.Coordinators(tuple(body.addresses))
    if isinstance(body, v1.HeartbeatAck):
        return m.HeartbeatAck(body.seq)
    if isinstance(body, v1.ReportAck):
        return m.ReportAck(body.report_seq, body.refused)
    if isinstance(body, v1.Prepare):
        return m.Prepare(
            key=_key(body.member),
            jobspec_json=body.jobspec_json,
            member_count=body.member_count,
            gpu_indexes=tuple(body.gpu_indexes),
            pick_rendezvous=body.pick_rendezvous,
            capsule_digests=dict(body.capsule_digests),
            capsule_files=dict(body.capsule_files),
            owner=body.owner,
            gpu_uuids=tuple(body.gpu_uuids),
            rendezvous_nonce=body.rendezvous_nonce,
            rendezvous=_rendezvous(body.rendezvous),
            init_from_fetch=_init_from_fetch(body.init_from_fetch),
        )
    if isinstance(body, v1.Commit):
        return m.Commit(
            _key(body.member),
            _rendezvous(body.rendezvous),
            collector_credential=body.collector_credential,
            telemetry_address=body.telemetry_address,
            telemetry_fallbacks=tuple(body.telemetry_fallbacks),
        )
    if isinstance(body, v1.Abort):
        return m.Abort(_key(body.member), body.reason)
    if isinstance(body, v1.Cancel):
        return m.Cancel(_key(body.member), body.reason, body.grace_period_s, body.declared_lost)
    if isinstance(body, v1.LogAck):
        return m.LogAck(_key(body.member), body.stream, body.offset, body.eof)
    if isinstance(body, v1.CredentialIssued):
        return m.CredentialIssued(
            body.request_id,
            body.node_credential,
            body.credential_issued_at_ms,
            body.credential_expires_at_ms,
        )
    raise UnknownMessage(
        f"The coordinator sent a message this agent does not understand ({name or 'empty'}); "
        "upgrade tuneplane-node to the coordinator's version."
    )


def _manifest(text: str) -> v1.OutputManifest:
    """A report's output manifest summary (journaled JSON) on the wire; empty when it has none."""
    summary = ManifestSummary.from_json(text)
    if summary is None:
        return v1.OutputManifest()
    return v1.OutputManifest(
        files=summary.files, bytes=summary.bytes, sha256=summary.sha256, problem=summary.problem
    )
