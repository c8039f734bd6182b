"""What ``tp job cancel``, ``tp job retry``, ``tp logs`` and ``node lost`` get back: attrs values,
no wire types.

Rules: like :mod:`~tuneplane.coordinator.apimodel`, nothing here imports grpclib or betterproto;
:mod:`~tuneplane.coordinator.apiclient` builds these from the Api's replies.
"""

from __future__ import annotations

import attrs

from tuneplane.coordinator.apimodel import Job
from tuneplane.coordinator.fleetmodel import Node

# CancelJobReply.outcome words.
CANCELLING = "cancelling"
CANCELLED = "cancelled"
ALREADY_CANCELLING = "already_cancelling"
ALREADY_CANCELLED = "already_cancelled"
ALREADY_ENDED = "already_ended"


@attrs.frozen
class CancelOutcome:
    outcome: str
    job: Job


@attrs.frozen
class RetryOutcome:
    # The number the new attempt gets when it is placed.
    attempt: int
    job: Job


@attrs.frozen
class LogPiece:
    """Contiguous bytes at ``offset``; ``dropped_before`` bytes before it are not kept."""

    offset: int
    data: bytes
    dropped_before: int


@attrs.frozen
class LogPage:
    """One GetLogs answer: the pieces, where to continue, and whether the stream ended."""

    attempt: int
    member_index: int
    stream: str
    pieces: tuple[LogPiece, ...]
    next_offset: int
    complete: bool
    dropped_bytes: int
    member_state: str


@attrs.frozen
class NodeLossOutcome:
    """What declaring a Node lost did: the Node now, the members it ended
    (``<run id>/<attempt>/<member>``) and the Jobs it changed, as they are now."""

    node: Node
    lost: tuple[str, ...]
    jobs: tuple[Job, ...]
