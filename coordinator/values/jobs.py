"""Jobs as the store records them and the Api returns them: the Job, its attempts and members,
their state histories, the preview a person confirms and the receipt of that confirmation.

Rules: frozen attrs values only (see :mod:`..values`); a field the Api does not carry has a
default, so ``tp`` builds the same class from a reply that the store builds from its rows.
"""

from __future__ import annotations

import attrs

from tuneplane.proto.contract.derivation_source import ManifestSummary

# How many Jobs one ListJobs answers: the default when a request names none (0, the wire's
# unset value) and the most it ever returns. ``tp job ls --limit`` accepts 1 to the most.
JOB_LIST_DEFAULT = 100
JOB_LIST_MAX = 1000


@attrs.frozen
class MemberKey:
    """One member of one attempt of one Job: what every order, report and point names."""

    run_id: str
    attempt: int
    member_index: int

    @property
    def text(self) -> str:
        """``<run id>/<attempt>/<member>``, as ``tp node show`` names a GPU's holder."""
        return f"{self.run_id}/{self.attempt}/{self.member_index}"


@attrs.frozen
class StateChange:
    state: str
    at_ms: int
    reason: str


@attrs.frozen
class ImagePreparation:
    """A preparing member's runtime image as its Node last reported it (PrepareProgress): a live
    view the coordinator keeps in memory, never stored."""

    image: str
    bytes_done: int
    bytes_total: int
    layers_done: int
    layers_total: int
    phase: str  # "pulling" or "unpacking"
    reported_at_ms: int


@attrs.frozen
class Member:
    index: int
    node_id: str
    state: str
    has_exit: bool
    exit_code: int
    signal: int
    out_dir: str
    gpu_indexes: tuple[int, ...]
    history: tuple[StateChange, ...]
    # When its Node said it ended (the exit report's at_ms, the Node's clock); 0 when unknown.
    ended_at_ms: int = 0
    # Its Node's display name (nodes.name); empty when the Node is unknown (or the coordinator
    # is older than names).
    node_name: str = ""
    # Its output manifest as its Node reported it when the member ended; None before that.
    output_manifest: ManifestSummary | None = None
    # While it is preparing and its Node pulls its runtime image: how far; None otherwise.
    preparation: ImagePreparation | None = None


@attrs.frozen
class Attempt:
    number: int
    state: str
    members: tuple[Member, ...]
    master_addr: str
    master_port: int
    created_at_ms: int


@attrs.frozen
class FirstFailure:
    """A failed Job's member that failed first, how, and the last lines of its stderr."""

    attempt: int
    member_index: int
    node_id: str
    state: str
    has_exit: bool
    exit_code: int
    signal: int
    at_ms: int
    what: str
    stderr_tail: str
    # True when older stderr exists that stderr_tail does not show.
    stderr_cut: bool


@attrs.frozen
class Job:
    run_id: str
    project: str
    experiment: str
    owner: str
    state: str
    fleet: str
    profile: str
    method_id: str
    preview_id: str
    digest: str
    init_from: str
    created_at_ms: int
    # Empty in a list (ListJobs, the store's list_jobs); filled for one Job (GetJob).
    history: tuple[StateChange, ...] = ()
    attempts: tuple[Attempt, ...] = ()
    # Why the Job is in its state now, e.g. "waiting: quota h200 4/4 in use" while queued.
    state_reason: str = ""
    # Only on a failed Job read with GetJob (``tp job show``); None otherwise.
    first_failure: FirstFailure | None = None
    # The runtime as admitted: host:<interpreter>, or image:<registry>/<name>@sha256:<hex>
    # pinned at Preview. "" for a Job admitted before the store kept it.
    runtime_id: str = ""


@attrs.frozen
class PreviewSummary:
    """What the person confirms: where the Job runs and what it asks for."""

    fleet: str
    backend: str
    series: str
    gpus_per_member: int
    members: int
    profile: str
    # The tag Preview resolved the runtime image from ("" when the JobSpec named a digest or a
    # host runtime); the resolved JobSpec names the pinned digest.
    image_tag: str = ""


@attrs.frozen
class Preview:
    """An immutable preview: the resolved JobSpec, its digest and its summary."""

    preview_id: str
    digest: str
    resolved_jobspec_json: str
    summary: PreviewSummary
    created_at_ms: int
    # Who asked for it; the store keeps it, the Api never sends it back ("" in ``tp``).
    owner: str = ""


@attrs.frozen
class Receipt:
    run_id: str
    preview_id: str
    digest: str
    retry_key: str
    admitted_at_ms: int
    # False when the coordinator returned the receipt of an earlier identical confirmation.
    created: bool
    # The kind of Fleet the Job was admitted to (node, kubernetes, slurm): who must plan it.
    # "" on an earlier receipt returned again, which admitted nothing, and on the wire.
    backend: str = ""


@attrs.frozen
class QueuedJob:
    """What the scheduler needs to place a queued Job."""

    run_id: str
    fleet: str
    series: str
    gpus: int
    members: int | None
    gpus_per_member: int | None
    resolved_json: str
    digest: str
    # The submitting user: a Node may run the Job's members as the local account of that name.
    owner: str = ""
