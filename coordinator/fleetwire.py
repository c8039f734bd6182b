"""tp's side of the Fleet and Node messages: betterproto to :mod:`.fleetmodel` values.

Rules: imported only by :mod:`tuneplane.coordinator.apiclient`, so betterproto stays out of the
commands that never talk to the coordinator; missing sub-messages become empty values, never None.
Every string is made printable first (:func:`~tuneplane.proto.contract.input_checks.printable`): a
Node's hostname or a GPU's health reason comes from that Node, and an escape sequence in it must
not reach the terminal of whoever runs ``tp node ls``.
"""

from __future__ import annotations

import betterproto

from tuneplane.coordinator.fleetmodel import Fleet, Gpu, Node, NodeMember, SeriesCapacity
from tuneplane.proto import v1
from tuneplane.proto.contract.input_checks import printable_message


def fleet_from_wire(msg: v1.Fleet) -> Fleet:
    printable_message(msg)
    return Fleet(
        name=msg.name,
        kind=msg.kind,
        created_at_ms=msg.created_at_ms,
        nodes=msg.nodes,
        connected_nodes=msg.connected_nodes,
        schedulable_nodes=msg.schedulable_nodes,
        capacity=tuple(
            SeriesCapacity(c.series, c.total, c.healthy, c.free, c.in_use, c.quota)
            for c in msg.capacity
        ),
        queued_jobs=msg.queued_jobs,
        active_jobs=msg.active_jobs,
    )


def _holder(g: v1.NodeGpu) -> str:
    if not betterproto.serialized_on_wire(g.held_by) or not g.held_by.run_id:
        return ""
    ref = g.held_by
    return f"{ref.run_id}/{ref.attempt}/{ref.member_index}"


def node_from_wire(msg: v1.Node) -> Node:
    printable_message(msg)
    inv = msg.inventory or v1.Inventory()
    return Node(
        id=msg.id,
        fleet=msg.fleet,
        hostname=msg.hostname,
        name=msg.name or msg.id,
        dialed_address=msg.dialed_address,
        outputs_address=msg.outputs_address,
        scheduling=msg.scheduling,
        scheduling_reason=msg.scheduling_reason,
        scheduling_changed_at_ms=msg.scheduling_changed_at_ms,
        scheduling_changed_by=msg.scheduling_changed_by,
        connected=msg.connected,
        disconnected_since_ms=msg.disconnected_since_ms,
        last_heartbeat_ms=msg.last_heartbeat_ms,
        enrolled_at_ms=msg.enrolled_at_ms,
        cpu_count=inv.cpu_count,
        memory_bytes=inv.memory_bytes,
        gpu_source=inv.gpu_source,
        driver_version=inv.driver_version,
        cuda_version=inv.cuda_version,
        gpus=tuple(
            Gpu(
                index=g.gpu.index,
                uuid=g.gpu.uuid,
                name=g.gpu.name,
                series=g.gpu.series,
                memory_bytes=g.gpu.memory_bytes,
                healthy=g.gpu.healthy,
                health_reason=g.gpu.health_reason,
                held_by=_holder(g),
            )
            for g in msg.gpus
        ),
        members=tuple(
            NodeMember(
                run_id=m.member.run_id,
                attempt=m.member.attempt,
                member_index=m.member.member_index,
                state=m.state,
                gpu_indexes=tuple(m.gpu_indexes),
                owner=m.owner,
            )
            for m in msg.members
        ),
        credential_issued_at_ms=msg.credential_issued_at_ms,
        credential_expires_at_ms=msg.credential_expires_at_ms,
        revoked_at_ms=msg.revoked_at_ms,
    )
