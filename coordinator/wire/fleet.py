"""The Api's Fleet and Node calls (ListFleets, GetFleet, ListNodes, GetNode, SetNodeScheduling,
RevokeNode): their messages to and from :mod:`..values.fleet`.

Rules: the Api handlers write with ``*_to_wire`` and ``tp``'s client reads with ``*_from_wire``.
A Node's GPUs travel twice, as its inventory and as ``gpus`` with who holds each; the value
keeps the inventory and the holders. Reading makes every string printable first
(:func:`~tuneplane.proto.contract.input_checks.printable_message`): a Node's hostname or a GPU's
health reason comes from that Node, and an escape sequence in it must not reach the terminal of
whoever runs ``tp node ls``.
"""

from __future__ import annotations

import betterproto

from tuneplane.proto import v1
from tuneplane.proto.contract.input_checks import printable_message

from ..values.fleet import (
    Fleet,
    Node,
    NodeMember,
    SeriesCapacity,
    SlurmPartition,
    SlurmPartitionNode,
    SlurmSeries,
)
from ..values.jobs import MemberKey
from .control import gpu_to_wire, inventory_from_wire, inventory_to_wire
from .members import member_key_as_sent, member_ref


def fleet_to_wire(fleet: Fleet) -> v1.Fleet:
    msg = v1.Fleet(
        name=fleet.name,
        kind=fleet.kind,
        created_at_ms=fleet.created_at_ms,
        nodes=fleet.nodes,
        connected_nodes=fleet.connected_nodes,
        schedulable_nodes=fleet.schedulable_nodes,
        capacity=[
            v1.SeriesCapacity(
                series=c.series,
                total=c.total,
                healthy=c.healthy,
                free=c.free,
                in_use=c.in_use,
                quota=c.quota,
            )
            for c in fleet.capacity
        ],
        queued_jobs=fleet.queued_jobs,
        active_jobs=fleet.active_jobs,
    )
    if fleet.slurm is not None:  # absent from the message otherwise (serialized_on_wire)
        msg.slurm = _slurm_to_wire(fleet.slurm)
    return msg


def _slurm_to_wire(slurm: SlurmPartition) -> v1.SlurmPartition:
    return v1.SlurmPartition(
        slurmrestd=slurm.slurmrestd,
        partition=slurm.partition,
        nodes=[
            v1.SlurmPartitionNode(
                name=n.name, state=n.state, cpus=n.cpus, gpus=n.gpus, gpus_used=n.gpus_used,
                gres=n.gres,
            )
            for n in slurm.nodes
        ],
        error=slurm.error,
        series=[
            v1.SlurmSeries(series=m.series, gres_type=m.gres_type, constraint=m.constraint)
            for m in slurm.series
        ],
        image_root=slurm.image_root,
        registries_file=slurm.registries_file,
    )  # fmt: skip


def _slurm_from_wire(msg: v1.Fleet, sent: bool) -> SlurmPartition | None:
    if not sent:
        return None
    s = msg.slurm
    return SlurmPartition(
        slurmrestd=s.slurmrestd,
        partition=s.partition,
        nodes=tuple(
            SlurmPartitionNode(n.name, n.state, n.cpus, n.gpus, n.gpus_used, n.gres)
            for n in s.nodes
        ),
        error=s.error,
        series=tuple(SlurmSeries(m.series, m.gres_type, m.constraint) for m in s.series),
        image_root=s.image_root,
        registries_file=s.registries_file,
    )


def fleet_from_wire(msg: v1.Fleet) -> Fleet:
    # Asked before printable_message, which sets every field it cleans and so marks an absent
    # SlurmPartition as sent.
    slurm_sent = betterproto.serialized_on_wire(msg.slurm)
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
        slurm=_slurm_from_wire(msg, slurm_sent),
    )


def fleets_to_wire(fleets: list[Fleet]) -> v1.ListFleetsReply:
    return v1.ListFleetsReply(fleets=[fleet_to_wire(f) for f in fleets])


def fleets_from_wire(reply: v1.ListFleetsReply) -> list[Fleet]:
    return [fleet_from_wire(f) for f in reply.fleets]


def node_to_wire(node: Node) -> v1.Node:
    gpus = []
    for g in node.inventory.gpus:
        holder = node.held_by.get(g.index)
        if holder is None:
            gpus.append(v1.NodeGpu(gpu=gpu_to_wire(g)))
        else:
            gpus.append(v1.NodeGpu(gpu=gpu_to_wire(g), held_by=member_ref(holder)))
    return v1.Node(
        id=node.id,
        fleet=node.fleet,
        hostname=node.hostname,
        name=node.name,
        dialed_address=node.dialed_address,
        outputs_address=node.outputs_address,
        scheduling=node.scheduling,
        scheduling_reason=node.scheduling_reason,
        scheduling_changed_at_ms=node.scheduling_changed_at_ms,
        scheduling_changed_by=node.scheduling_changed_by,
        connected=node.connected,
        disconnected_since_ms=node.disconnected_since_ms,
        last_heartbeat_ms=node.last_heartbeat_ms,
        enrolled_at_ms=node.enrolled_at_ms,
        inventory=inventory_to_wire(node.inventory),
        gpus=gpus,
        members=[
            v1.NodeMember(
                member=member_ref(m.member),
                state=m.state,
                gpu_indexes=list(m.gpu_indexes),
                owner=m.owner,
            )
            for m in node.members
        ],
        credential_issued_at_ms=node.credential_issued_at_ms,
        credential_expires_at_ms=node.credential_expires_at_ms,
        revoked_at_ms=node.revoked_at_ms,
    )


def _holders(gpus: list[v1.NodeGpu]) -> dict[int, MemberKey]:
    return {
        g.gpu.index: member_key_as_sent(g.held_by)
        for g in gpus
        if betterproto.serialized_on_wire(g.held_by) and g.held_by.run_id
    }


def node_from_wire(msg: v1.Node) -> Node:
    """A Node; its display name is its id when the coordinator is older than names."""
    printable_message(msg)
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
        inventory=inventory_from_wire(msg.inventory, msg.hostname),
        held_by=_holders(msg.gpus),
        members=tuple(
            NodeMember(member_key_as_sent(m.member), m.state, tuple(m.gpu_indexes), m.owner)
            for m in msg.members
        ),
        credential_issued_at_ms=msg.credential_issued_at_ms,
        credential_expires_at_ms=msg.credential_expires_at_ms,
        revoked_at_ms=msg.revoked_at_ms,
    )


def nodes_to_wire(nodes: list[Node]) -> v1.ListNodesReply:
    return v1.ListNodesReply(nodes=[node_to_wire(n) for n in nodes])


def nodes_from_wire(reply: v1.ListNodesReply) -> list[Node]:
    return [node_from_wire(n) for n in reply.nodes]
