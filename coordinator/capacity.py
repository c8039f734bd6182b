"""Refuse at preview what can never run: a request no Fleet state could ever place.

Rules:
- Pure: takes the request, the healthy GPUs of the Series on each enrolled Node of the Fleet, and
  the Fleet's quota for the Series; returns a :class:`JobSpecError` to raise, or None.
- "Never" means even with every GPU free: over the quota, more than 32 members, or a shape that
  the Fleet's enrolled Nodes cannot hold. A Fleet with no Nodes yet refuses only the first two,
  since its Nodes may still enroll.
"""

from __future__ import annotations

from collections.abc import Sequence

from tuneplane.proto.contract.jobspec import JobSpecError

from .placement import MAX_MEMBERS, NodeOffer, Request, candidate_shapes, place


def never_fits(
    request: Request,
    fleet: str,
    series: str,
    healthy_per_node: Sequence[int],
    quota: int | None,
) -> JobSpecError | None:
    """Why ``request`` can never be placed on ``fleet``, as the error to raise; None if it can."""
    if quota is not None and request.gpus > quota:
        return JobSpecError(
            "resources.gpus",
            request.gpus,
            f"is more than the quota of Fleet {fleet}, which lets Jobs hold at most {quota} "
            f"{series} GPU(s) at once, so the Job could never start",
            f"Ask for at most {quota} GPUs, or ask the operator to raise the quota.",
        )
    if not candidate_shapes(request, MAX_MEMBERS):
        return JobSpecError(
            "resources.gpus",
            request.gpus,
            f"cannot be split into at most {MAX_MEMBERS} equal members"
            + (f" of {request.gpus_per_member} GPU(s)" if request.gpus_per_member else ""),
            "Ask for fewer GPUs, or more GPUs per member.",
        )
    if not healthy_per_node:
        return None
    whole = [NodeOffer(str(i), tuple(range(n))) for i, n in enumerate(healthy_per_node)]
    if place(request, whole) is None:
        return JobSpecError(
            "resources.gpus",
            request.gpus,
            f"can never fit Fleet {fleet}: its {len(healthy_per_node)} Node(s) have "
            f"{sum(healthy_per_node)} healthy {series} GPU(s) in all, at most "
            f"{max(healthy_per_node)} on one Node, and a Job has at most one member per Node",
            "Ask for fewer GPUs, or a shape the Fleet's Nodes can hold.",
        )
    return None
