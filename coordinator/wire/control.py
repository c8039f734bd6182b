"""The Node boundary (``tuneplane.v1.Control``): the control stream's messages to and from
:mod:`..values.orders`.

Rules: the control gateway and the session registry convert here and nowhere else; a message
from a Node that the protocol does not allow is a :class:`~.errors.BadMessage` (a member state
a Node may not report, a message that names no member). Both directions are here: what a Node
sends is read with ``*_from_wire`` and what the coordinator sends is written with ``*_to_wire``;
the other direction of each says exactly what the first one reads or writes.
"""

from __future__ import annotations

import logging

import betterproto

from tuneplane.proto import v1

from .. import capsule
from ..values.orders import (
    AbortOrder,
    CancelOrder,
    CommitOrder,
    Gpu,
    HeldMember,
    InitFromFetch,
    Inventory,
    Order,
    OutputsService,
    PrepareOrder,
    Report,
)
from .errors import BadMessage
from .members import manifest_from_wire, manifest_to_wire, member_key, member_ref

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
_STATE_VALUES: dict[str, v1.MemberState] = {
    name: v1.MemberState(state) for state, name in _STATE_NAMES.items()
}
#: The member states a Node may report, as the coordinator names them.
REPORTED_STATES: tuple[str, ...] = tuple(_STATE_NAMES.values())


def member_state_name(state: v1.MemberState | int) -> str:
    try:
        return _STATE_NAMES[int(state)]
    except KeyError:
        raise BadMessage(
            f"member state {int(state)} is not one a Node may report. Upgrade the Node."
        ) from None


def member_state_value(name: str) -> v1.MemberState:
    """The wire's value of a member state a Node may report (``KeyError`` for any other)."""
    return _STATE_VALUES[name]


# -- inventory ----------------------------------------------------------------------------------


def gpu_from_wire(g: v1.Gpu) -> Gpu:
    return Gpu(
        index=g.index,
        series=g.series,
        healthy=g.healthy,
        uuid=g.uuid,
        name=g.name,
        memory_bytes=g.memory_bytes,
        mig_enabled=g.mig_enabled,
        health_reason=g.health_reason,
    )


def gpu_to_wire(g: Gpu) -> v1.Gpu:
    return v1.Gpu(
        index=g.index,
        uuid=g.uuid,
        name=g.name,
        series=g.series,
        memory_bytes=g.memory_bytes,
        mig_enabled=g.mig_enabled,
        healthy=g.healthy,
        health_reason=g.health_reason,
    )


def inventory_from_wire(inv: v1.Inventory | None, hostname: str = "") -> Inventory:
    """A Node's inventory; ``hostname`` where it names none, and GPU source ``none`` where it
    names no source."""
    if inv is None:
        return Inventory(hostname=hostname)
    return Inventory(
        hostname=inv.hostname or hostname,
        gpus=tuple(gpu_from_wire(g) for g in inv.gpus),
        gpu_source=inv.gpu_source or "none",
        cpu_count=inv.cpu_count,
        memory_bytes=inv.memory_bytes,
        driver_version=inv.driver_version,
        cuda_version=inv.cuda_version,
    )


def inventory_to_wire(inv: Inventory) -> v1.Inventory:
    return v1.Inventory(
        hostname=inv.hostname,
        cpu_count=inv.cpu_count,
        memory_bytes=inv.memory_bytes,
        gpus=[gpu_to_wire(g) for g in inv.gpus],
        gpu_source=inv.gpu_source,
        driver_version=inv.driver_version,
        cuda_version=inv.cuda_version,
    )


# -- Hello ----------------------------------------------------------------------------------------


def held_from_wire(hello: v1.Hello) -> list[HeldMember]:
    """The members a Hello says its Node holds; one the coordinator cannot read is skipped."""
    held = []
    for h in hello.held:
        try:
            held.append(HeldMember(member_key(h.member), member_state_name(h.state)))
        except BadMessage:
            log.warning("hello names a held member the coordinator cannot read; skipping it")
    return held


def held_to_wire(held: HeldMember) -> v1.HeldMember:
    return v1.HeldMember(member=member_ref(held.member), state=member_state_value(held.state))


def outputs_from_wire(hello: v1.Hello) -> OutputsService | None:
    """What Hello.outputs says, unchecked (:func:`..outputs_grants.check_service` judges it);
    None when the Node serves no outputs (unset, or an empty address)."""
    msg = hello.outputs
    if not betterproto.serialized_on_wire(msg) or not msg.address:
        return None
    return OutputsService(msg.address, msg.cert_sha256, bytes(msg.grant_key))


def outputs_to_wire(service: OutputsService) -> v1.OutputsService:
    return v1.OutputsService(
        address=service.address, cert_sha256=service.cert_sha256, grant_key=service.grant_key
    )


# -- member reports -------------------------------------------------------------------------------


def report_from_wire(msg: v1.MemberReport) -> Report:
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


def report_to_wire(report: Report) -> v1.MemberReport:
    return v1.MemberReport(
        report_seq=report.report_seq,
        member=member_ref(report.member),
        state=member_state_value(report.state),
        at_ms=report.at_ms,
        reason=report.reason,
        has_exit=report.has_exit,
        exit_code=report.exit_code,
        signal=report.signal,
        out_dir=report.out_dir,
        journal_id=report.journal_id,
        output_manifest=manifest_to_wire(report.manifest),
    )


# -- orders -------------------------------------------------------------------------------------


def _prepare_to_wire(order: PrepareOrder) -> v1.Prepare:
    prepare = v1.Prepare(
        member=member_ref(order.member),
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
    if order.master_port:
        prepare.rendezvous = v1.Rendezvous(
            master_addr=order.master_addr, master_port=order.master_port
        )
    fetch = order.init_from_fetch
    if fetch is not None:
        prepare.init_from_fetch = v1.InitFromFetch(
            address=fetch.address,
            cert_sha256=fetch.cert_sha256,
            grant=fetch.grant,
            grant_expires_at_ms=fetch.grant_expires_at_ms,
        )
    return prepare


def order_to_wire(order: Order) -> v1.CoordinatorMessage:
    """The CoordinatorMessage that carries ``order`` to its Node."""
    ref = member_ref(order.member)
    if isinstance(order, PrepareOrder):
        return v1.CoordinatorMessage(prepare=_prepare_to_wire(order))
    if isinstance(order, CommitOrder):
        return v1.CoordinatorMessage(
            commit=v1.Commit(
                member=ref,
                rendezvous=v1.Rendezvous(
                    master_addr=order.master_addr, master_port=order.master_port
                ),
                collector_credential=order.collector_credential,
                telemetry_address=order.telemetry_address,
                telemetry_fallbacks=list(order.telemetry_fallbacks),
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


def _prepare_from_wire(node_id: str, p: v1.Prepare) -> PrepareOrder:
    fetch = None
    if betterproto.serialized_on_wire(p.init_from_fetch):
        f = p.init_from_fetch
        fetch = InitFromFetch(f.address, f.cert_sha256, f.grant, f.grant_expires_at_ms)
    rdv = p.rendezvous
    try:
        files = {name: data.decode("utf-8") for name, data in p.capsule_files.items()}
    except UnicodeDecodeError:
        raise BadMessage("Prepare.capsule_files holds a file that is not UTF-8 text.") from None
    return PrepareOrder(
        node_id=node_id,
        member=member_key(p.member),
        jobspec_json=p.jobspec_json,
        member_count=p.member_count,
        gpu_indexes=tuple(p.gpu_indexes),
        pick_rendezvous=p.pick_rendezvous,
        capsule_files=files,
        owner=p.owner,
        gpu_uuids=tuple(p.gpu_uuids),
        rendezvous_nonce=p.rendezvous_nonce,
        master_addr=rdv.master_addr if rdv else "",
        master_port=rdv.master_port if rdv else 0,
        init_from_fetch=fetch,
    )


def order_from_wire(node_id: str, msg: v1.CoordinatorMessage) -> Order:
    """The order a CoordinatorMessage carries to ``node_id`` (what :func:`order_to_wire`
    wrote); a message that carries no order is a :class:`~.errors.BadMessage`."""
    kind, body = betterproto.which_one_of(msg, "body")
    if isinstance(body, v1.Prepare):
        return _prepare_from_wire(node_id, body)
    if isinstance(body, v1.Commit):
        rdv = body.rendezvous
        return CommitOrder(
            node_id,
            member_key(body.member),
            rdv.master_addr if rdv else "",
            rdv.master_port if rdv else 0,
            body.collector_credential,
            body.telemetry_address,
            tuple(body.telemetry_fallbacks),
        )
    if isinstance(body, v1.Abort):
        return AbortOrder(node_id, member_key(body.member), body.reason)
    if isinstance(body, v1.Cancel):
        return CancelOrder(
            node_id,
            member_key(body.member),
            body.reason,
            body.grace_period_s,
            body.declared_lost,
        )
    raise BadMessage(f"the CoordinatorMessage carries {kind or 'nothing'}, not an order.")
