"""Placement: which Nodes and which GPUs a Job's members get. Pure: no clock, no store, no I/O.

Rules:
- Every member gets the same number of GPUs; a Job has at most one member per Node and at most
  :data:`MAX_MEMBERS` members; a GPU is offered only if it is healthy, of the Series and free.
- With no fixed shape, a Job gets as FEW members as the free GPUs allow (fewer Nodes, less
  cross-Node traffic). A Job asking for 0 GPUs gets one member on any Node.
- Only a ``schedulable`` Node is offered work: a ``cordoned``, ``draining`` or ``drained`` Node
  takes no new members, whatever it has free.
- Among Nodes that fit, the one with the fewest free GPUs is chosen first (best fit), so big holes
  stay big for big Jobs; ties break on the Node id so placement is deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

MAX_MEMBERS = 32

# A Node's scheduling state, set by an admin (cordon, drain) and independent of connectivity.
SCHEDULABLE = "schedulable"
CORDONED = "cordoned"
DRAINING = "draining"
DRAINED = "drained"
SCHEDULING_STATES = (SCHEDULABLE, CORDONED, DRAINING, DRAINED)


@attrs.frozen
class Request:
    """A Job's ask: ``gpus`` in total, optionally a fixed member count or per-member shape."""

    gpus: int
    members: int | None = None
    gpus_per_member: int | None = None


@attrs.frozen
class NodeOffer:
    """One connected Node, its free, healthy GPU indexes of the Job's Series, and whether it
    takes new members (only when ``scheduling`` is :data:`SCHEDULABLE`)."""

    node_id: str
    free_gpus: tuple[int, ...]
    scheduling: str = SCHEDULABLE


@attrs.frozen
class MemberPlacement:
    index: int
    node_id: str
    gpu_indexes: tuple[int, ...]


@attrs.frozen
class Placement:
    members: tuple[MemberPlacement, ...]

    @property
    def gpus_per_member(self) -> int:
        return len(self.members[0].gpu_indexes) if self.members else 0


def candidate_shapes(request: Request, node_count: int) -> list[tuple[int, int]]:
    """(members, gpus per member) shapes to try, fewest members first."""
    limit = min(MAX_MEMBERS, node_count)
    if request.members is not None:
        m = request.members
        if m < 1 or m > limit:
            return []
        if request.gpus % m:
            return []
        return [(m, request.gpus // m)]
    if request.gpus_per_member is not None:
        g = request.gpus_per_member
        if g == 0:
            return [(1, 0)] if request.gpus == 0 and limit >= 1 else []
        if request.gpus % g:
            return []
        m = request.gpus // g
        return [(m, g)] if 1 <= m <= limit else []
    if request.gpus == 0:
        return [(1, 0)] if limit >= 1 else []
    return [(m, request.gpus // m) for m in range(1, limit + 1) if request.gpus % m == 0]


def place(request: Request, offers: Sequence[NodeOffer]) -> Placement | None:
    """Choose Nodes and GPUs for every member, or None when the free GPUs do not allow it now."""
    if request.gpus < 0:
        return None
    by_node: dict[str, tuple[int, ...]] = {}
    for offer in offers:
        if offer.scheduling != SCHEDULABLE:
            continue
        # One offer per Node: a duplicate would let two members land on the same Node.
        if offer.node_id not in by_node:
            by_node[offer.node_id] = tuple(sorted(set(offer.free_gpus)))
    for members, per_member in candidate_shapes(request, len(by_node)):
        fitting = sorted(
            ((len(free), node_id) for node_id, free in by_node.items() if len(free) >= per_member),
        )
        if len(fitting) < members:
            continue
        chosen = sorted(node_id for _, node_id in fitting[:members])
        return Placement(
            tuple(
                MemberPlacement(index=i, node_id=node_id, gpu_indexes=by_node[node_id][:per_member])
                for i, node_id in enumerate(chosen)
            )
        )
    return None
