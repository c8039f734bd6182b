"""The JobSpec's values (``tuneplane/v1``): :class:`JobSpec`, :class:`Resources`, the error.

Rules: frozen values only; reading, checking and digesting them is :mod:`.jobspec` and
:mod:`.jobspec_rules`. Part of the protocol's contract (:mod:`tuneplane.proto.contract`):
imports nothing from the coordinator, the agent, the collector or the runner.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from .derivation_source import InitFromSource

API_VERSION = "tuneplane/v1"


class JobSpecError(ValueError):
    """A JobSpec field is wrong. ``str()`` is a sentence a researcher can act on."""

    def __init__(self, field: str, value: object, why: str, fix: str) -> None:
        self.field = field
        self.value = value
        self.why = why
        self.fix = fix
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        super().__init__(f"JobSpec field '{field}' = {shown}: {why}. {fix}")

    def __reduce__(self) -> tuple[Callable[..., JobSpecError], tuple[str, str, str, str]]:
        # Raised in a worker process too (the coordinator's offload.in_process) and
        # pickled back to the event loop: the value goes as its shown text, so a refused 15 MiB
        # list costs nothing.
        return (_unpickled_error, (self.field, self.why, self.fix, str(self)))


def _unpickled_error(field: str, why: str, fix: str, message: str) -> JobSpecError:
    """A :class:`JobSpecError` back from a worker process; ``value`` is its shown text."""
    error = JobSpecError.__new__(JobSpecError)
    ValueError.__init__(error, message)
    error.field, error.why, error.fix = field, why, fix
    error.value = message.partition(" = ")[2].partition(f": {why}. ")[0]
    return error


@attrs.frozen
class Resources:
    """What the Job asks for: ``gpus`` cards of one Series, in one homogeneous Resource Pool.

    ``members`` and ``gpus_per_member`` are optional: when absent, placement uses as few members
    as the Nodes' free healthy GPUs allow, every member with the same number of GPUs.
    """

    profile: str
    series: str
    gpus: int
    members: int | None = None
    gpus_per_member: int | None = None


@attrs.frozen
class JobSpec:
    api_version: str
    project: str
    experiment: str
    method_id: str
    recipe_digest: str
    runtime_id: str
    entrypoint: tuple[str, ...]
    resources: Resources
    parameters: Mapping[str, Any] = attrs.field(factory=dict)
    env: Mapping[str, str] = attrs.field(factory=dict)
    grace_period_s: int = 30
    init_from: str | None = None
    # Experiment files, relative path -> base64 content; materialised in the member's work dir.
    source_files: Mapping[str, str] = attrs.field(factory=dict)
    # TunePlane users besides the owner who may read this Job (state, logs, metrics): the
    # project's `share_with` in tuneplane.yaml. Reading only; changing a Job stays the owner's.
    share_with: tuple[str, ...] = ()
    # Filled by the coordinator at Preview, never by the intent (tuneplane.coordinator.parameters):
    # what every rank execs (the entrypoint, placeholders filled, then the recipe's parameter
    # flags) and the TUNEPLANE_PARAM_* variables it gets. The digest covers both; the Node runs
    # them as they are. Empty in a JobSpec admitted before they existed.
    command: tuple[str, ...] = ()
    parameter_env: Mapping[str, str] = attrs.field(factory=dict)
    # Filled by the coordinator at Preview from ``init_from`` (tuneplane.coordinator.derivation):
    # the source artifact, its place and its manifest's digest, so the digest covers which bytes
    # the run begins from. None without a Derivation (and absent from the JSON then).
    init_from_source: InitFromSource | None = None
