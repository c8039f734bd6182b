"""What the coordinator's Api returns, as ``tp`` sees it: attrs values, the endpoint, typed errors.

Rules: nothing here imports grpclib or betterproto, so commands that never talk to the coordinator
(init, new, recipe) start fast; :mod:`tuneplane.coordinator.apiclient` converts wire messages into
these values and wire errors into these exceptions.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from tuneplane.agent.host_port import join_host_port
from tuneplane.proto.contract.derivation_source import ManifestSummary

# How many Jobs one ListJobs answers: the default when a request names none (0, the wire's
# unset value) and the most it ever returns. ``tp job ls --limit`` accepts 1 to the most.
JOB_LIST_DEFAULT = 100
JOB_LIST_MAX = 1000


class ApiError(Exception):
    """A call to the coordinator did not succeed; ``str()`` says why and what to do."""


class RequestRefused(ApiError):
    """The coordinator answered and refused the request; ``str()`` is its sentence."""

    def __init__(self, status: str, message: str) -> None:
        self.status = status
        super().__init__(message)


class CoordinatorUnreachable(ApiError):
    """No answer: the address is wrong, the coordinator is down, TLS failed or time ran out."""


class ClientConfigError(ApiError):
    """The CA file cannot be used to set up TLS."""


@attrs.frozen
class Endpoint:
    """A coordinator API address, the CA that must vouch for it, and the caller's token."""

    host: str
    port: int
    ca_path: Path
    token: str = attrs.field(repr=False)

    @property
    def address(self) -> str:
        return join_host_port(self.host, self.port)


@attrs.frozen
class PreviewSummary:
    fleet: str
    backend: str
    series: str
    gpus_per_member: int
    members: int
    profile: str


@attrs.frozen
class Preview:
    preview_id: str
    digest: str
    resolved_jobspec_json: str
    summary: PreviewSummary
    created_at_ms: int


@attrs.frozen
class Receipt:
    run_id: str
    preview_id: str
    digest: str
    retry_key: str
    admitted_at_ms: int
    # False when the coordinator returned the receipt of an earlier identical confirmation.
    created: bool


@attrs.frozen
class StateChange:
    state: str
    at_ms: int
    reason: str


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
    # Its Node's display name; empty when not known (an older coordinator).
    node_name: str = ""
    # Its output manifest as its Node reported it when the member ended; None before that.
    output_manifest: ManifestSummary | None = None


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
class Attempt:
    number: int
    state: str
    members: tuple[Member, ...]
    master_addr: str
    master_port: int
    created_at_ms: int


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
    history: tuple[StateChange, ...]
    attempts: tuple[Attempt, ...]
    created_at_ms: int
    init_from: str
    # Why the Job is in its state now, e.g. "waiting: quota h200 4/4 in use" while queued.
    state_reason: str = ""
    # Only on a failed Job read with GetJob (``tp job show``); None otherwise.
    first_failure: FirstFailure | None = None
