"""The Api's Job lifecycle calls (CancelJob, RetryJob, GetLogs) and DeclareNodeLost: their
replies to and from :mod:`..values.lifecycle`.

Rules: the handlers write with ``*_to_wire`` and ``tp``'s client reads with ``*_from_wire``; the
Jobs and the Node inside a reply go through :mod:`.jobs` and :mod:`.fleet`. A reply without its
Job or Node reads as an empty one, never as an error.
"""

from __future__ import annotations

from tuneplane.proto import v1

from ..values.lifecycle import CancelOutcome, LogPage, LogPiece, NodeLossOutcome, RetryOutcome
from .fleet import node_from_wire, node_to_wire
from .jobs import job_from_wire, job_to_wire
from .members import member_key_as_sent, member_ref


def cancel_to_wire(done: CancelOutcome) -> v1.CancelJobReply:
    return v1.CancelJobReply(outcome=done.outcome, job=job_to_wire(done.job))


def cancel_from_wire(reply: v1.CancelJobReply) -> CancelOutcome:
    return CancelOutcome(reply.outcome, job_from_wire(reply.job or v1.Job()))


def retry_to_wire(done: RetryOutcome) -> v1.RetryJobReply:
    return v1.RetryJobReply(attempt=done.attempt, job=job_to_wire(done.job))


def retry_from_wire(reply: v1.RetryJobReply) -> RetryOutcome:
    return RetryOutcome(reply.attempt, job_from_wire(reply.job or v1.Job()))


def logs_to_wire(page: LogPage) -> v1.GetLogsReply:
    return v1.GetLogsReply(
        attempt=page.attempt,
        member_index=page.member_index,
        stream=page.stream,
        pieces=[
            v1.LogPiece(offset=p.offset, data=p.data, dropped_before=p.dropped_before)
            for p in page.pieces
        ],
        next_offset=page.next_offset,
        complete=page.complete,
        dropped_bytes=page.dropped_bytes,
        member_state=page.member_state,
    )


def logs_from_wire(r: v1.GetLogsReply) -> LogPage:
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


def node_loss_to_wire(loss: NodeLossOutcome) -> v1.DeclareNodeLostReply:
    return v1.DeclareNodeLostReply(
        node=node_to_wire(loss.node),
        lost=[member_ref(k) for k in loss.lost],
        jobs=[job_to_wire(j) for j in loss.jobs],
    )


def node_loss_from_wire(reply: v1.DeclareNodeLostReply) -> NodeLossOutcome:
    return NodeLossOutcome(
        node_from_wire(reply.node or v1.Node()),
        tuple(member_key_as_sent(m) for m in reply.lost),
        tuple(job_from_wire(j) for j in reply.jobs),
    )
