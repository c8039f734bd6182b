"""What changing a Job's course gives back: a cancel's outcome, a retry's new attempt, a page
of a member's logs, and what declaring a Node lost did.

Rules: frozen attrs values only (see :mod:`..values`); the outcome words are the ones
``CancelJobReply.outcome`` carries, decided by :mod:`..store_lifecycle`.
"""

from __future__ import annotations

import attrs

from .fleet import Node
from .jobs import Job, MemberKey

# What a cancel did, as CancelJobReply.outcome names it.
CANCELLING = "cancelling"
CANCELLED = "cancelled"
ALREADY_CANCELLING = "already_cancelling"
ALREADY_CANCELLED = "already_cancelled"
ALREADY_ENDED = "already_ended"


@attrs.frozen
class CancelOutcome:
    """A cancel's outcome word and the Job as it is after it."""

    outcome: str
    job: Job


@attrs.frozen
class RetryOutcome:
    # The number the new attempt gets when it is placed.
    attempt: int
    job: Job


@attrs.frozen
class LogPiece:
    """Contiguous bytes starting at ``offset``; ``dropped_before`` bytes before it are gone."""

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
    """What declaring a Node lost did: the Node now, the members it ended and the Jobs it
    changed, as they are now."""

    node: Node
    lost: tuple[MemberKey, ...]
    jobs: tuple[Job, ...]
