"""The Api's Job calls (Preview, Commit, GetJob, ListJobs): their messages to and from
:mod:`..values.jobs`.

Rules: the Api handlers write with ``*_to_wire`` and ``tp``'s client reads with ``*_from_wire``,
here and nowhere else. A sub-message the server did not set comes back as its value's default
(a Job with no first failure, an attempt with no rendezvous), never as an error. A preview's
owner stays on the server: the Api never sends it.
"""

from __future__ import annotations

import betterproto

from tuneplane.proto import v1

from ..values.jobs import (
    Attempt,
    FirstFailure,
    ImagePreparation,
    Job,
    Member,
    Preview,
    PreviewSummary,
    Receipt,
    StateChange,
)
from .members import manifest_from_wire, manifest_to_wire


def _changes_to_wire(history: tuple[StateChange, ...]) -> list[v1.StateChange]:
    return [v1.StateChange(state=h.state, at_ms=h.at_ms, reason=h.reason) for h in history]


def _changes_from_wire(items: list[v1.StateChange]) -> tuple[StateChange, ...]:
    return tuple(StateChange(c.state, c.at_ms, c.reason) for c in items)


def member_to_wire(m: Member) -> v1.Member:
    return v1.Member(
        index=m.index,
        node_id=m.node_id,
        state=m.state,
        has_exit=m.has_exit,
        exit_code=m.exit_code,
        signal=m.signal,
        out_dir=m.out_dir,
        gpu_indexes=list(m.gpu_indexes),
        history=_changes_to_wire(m.history),
        ended_at_ms=m.ended_at_ms,
        node_name=m.node_name,
        output_manifest=manifest_to_wire(m.output_manifest),
        preparation=_preparation_to_wire(m.preparation),
    )


def _preparation_to_wire(p: ImagePreparation | None) -> v1.ImagePreparation:
    """Member.preparation; empty (no image) for a member not pulling an image."""
    if p is None:
        return v1.ImagePreparation()
    return v1.ImagePreparation(
        image=p.image, bytes_done=p.bytes_done, bytes_total=p.bytes_total,
        layers_done=p.layers_done, layers_total=p.layers_total, phase=p.phase,
        reported_at_ms=p.reported_at_ms,
    )  # fmt: skip


def _preparation_from_wire(p: v1.ImagePreparation | None) -> ImagePreparation | None:
    """Member.preparation; None when the server set none (any member not pulling an image)."""
    if p is None or not betterproto.serialized_on_wire(p) or not p.image:
        return None
    return ImagePreparation(
        p.image, p.bytes_done, p.bytes_total, p.layers_done, p.layers_total, p.phase,
        p.reported_at_ms,
    )  # fmt: skip


def member_from_wire(m: v1.Member) -> Member:
    return Member(
        index=m.index,
        node_id=m.node_id,
        state=m.state,
        has_exit=m.has_exit,
        exit_code=m.exit_code,
        signal=m.signal,
        out_dir=m.out_dir,
        gpu_indexes=tuple(m.gpu_indexes),
        history=_changes_from_wire(m.history),
        ended_at_ms=m.ended_at_ms,
        node_name=m.node_name,
        output_manifest=manifest_from_wire(m.output_manifest),
        preparation=_preparation_from_wire(m.preparation),
    )


def attempt_to_wire(a: Attempt) -> v1.Attempt:
    return v1.Attempt(
        number=a.number,
        state=a.state,
        rendezvous=v1.Rendezvous(master_addr=a.master_addr, master_port=a.master_port),
        created_at_ms=a.created_at_ms,
        members=[member_to_wire(m) for m in a.members],
    )


def attempt_from_wire(a: v1.Attempt) -> Attempt:
    rdv = a.rendezvous
    return Attempt(
        number=a.number,
        state=a.state,
        members=tuple(member_from_wire(m) for m in a.members),
        master_addr=rdv.master_addr if rdv else "",
        master_port=rdv.master_port if rdv else 0,
        created_at_ms=a.created_at_ms,
    )


def first_failure_to_wire(f: FirstFailure) -> v1.FirstFailure:
    return v1.FirstFailure(
        attempt=f.attempt,
        member_index=f.member_index,
        node_id=f.node_id,
        state=f.state,
        has_exit=f.has_exit,
        exit_code=f.exit_code,
        signal=f.signal,
        at_ms=f.at_ms,
        what=f.what,
        stderr_tail=f.stderr_tail,
        stderr_cut=f.stderr_cut,
    )


def first_failure_from_wire(f: v1.FirstFailure | None) -> FirstFailure | None:
    """Job.first_failure; None when the server set none (any Job that has not failed)."""
    if f is None or not betterproto.serialized_on_wire(f):
        return None
    return FirstFailure(
        attempt=f.attempt,
        member_index=f.member_index,
        node_id=f.node_id,
        state=f.state,
        has_exit=f.has_exit,
        exit_code=f.exit_code,
        signal=f.signal,
        at_ms=f.at_ms,
        what=f.what,
        stderr_tail=f.stderr_tail,
        stderr_cut=f.stderr_cut,
    )


def job_to_wire(job: Job) -> v1.Job:
    msg = v1.Job(
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
        history=_changes_to_wire(job.history),
        attempts=[attempt_to_wire(a) for a in job.attempts],
        created_at_ms=job.created_at_ms,
        init_from=job.init_from,
        state_reason=job.state_reason,
        runtime_id=job.runtime_id,
    )
    if job.first_failure is not None:
        msg.first_failure = first_failure_to_wire(job.first_failure)
    return msg


def job_from_wire(msg: v1.Job) -> Job:
    return Job(
        run_id=msg.run_id,
        project=msg.project,
        experiment=msg.experiment,
        owner=msg.owner,
        state=msg.state,
        fleet=msg.fleet,
        profile=msg.profile,
        method_id=msg.method_id,
        preview_id=msg.preview_id,
        digest=msg.digest,
        init_from=msg.init_from,
        created_at_ms=msg.created_at_ms,
        history=_changes_from_wire(msg.history),
        attempts=tuple(attempt_from_wire(a) for a in msg.attempts),
        state_reason=msg.state_reason,
        runtime_id=msg.runtime_id,
        first_failure=first_failure_from_wire(msg.first_failure),
    )


def jobs_to_wire(jobs: list[Job]) -> v1.ListJobsReply:
    return v1.ListJobsReply(jobs=[job_to_wire(j) for j in jobs])


def jobs_from_wire(reply: v1.ListJobsReply) -> list[Job]:
    return [job_from_wire(j) for j in reply.jobs]


def summary_to_wire(s: PreviewSummary) -> v1.PreviewSummary:
    return v1.PreviewSummary(
        fleet=s.fleet,
        backend=s.backend,
        series=s.series,
        gpus_per_member=s.gpus_per_member,
        members=s.members,
        profile=s.profile,
        image_tag=s.image_tag,
    )


def summary_from_wire(s: v1.PreviewSummary | None) -> PreviewSummary:
    s = s or v1.PreviewSummary()
    return PreviewSummary(
        s.fleet, s.backend, s.series, s.gpus_per_member, s.members, s.profile, s.image_tag
    )


def preview_to_wire(preview: Preview) -> v1.PreviewReply:
    """The PreviewReply for ``preview`` (its owner stays on the server)."""
    return v1.PreviewReply(
        preview_id=preview.preview_id,
        digest=preview.digest,
        resolved_jobspec_json=preview.resolved_jobspec_json,
        summary=summary_to_wire(preview.summary),
        created_at_ms=preview.created_at_ms,
    )


def preview_from_wire(reply: v1.PreviewReply) -> Preview:
    return Preview(
        preview_id=reply.preview_id,
        digest=reply.digest,
        resolved_jobspec_json=reply.resolved_jobspec_json,
        summary=summary_from_wire(reply.summary),
        created_at_ms=reply.created_at_ms,
    )


def receipt_to_wire(r: Receipt) -> v1.Receipt:
    return v1.Receipt(
        run_id=r.run_id,
        preview_id=r.preview_id,
        digest=r.digest,
        retry_key=r.retry_key,
        admitted_at_ms=r.admitted_at_ms,
        created=r.created,
    )


def receipt_from_wire(r: v1.Receipt) -> Receipt:
    return Receipt(r.run_id, r.preview_id, r.digest, r.retry_key, r.admitted_at_ms, r.created)
