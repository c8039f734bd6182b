"""The coordinator's site policy over a JobSpec, applied at Preview and again at launch.

Rules: the JobSpec itself (its value classes, parsing, canonical JSON and digest) is part of the
protocol's contract, :mod:`tuneplane.proto.contract.jobspec`, which knows no site. What only this
coordinator decides lives here, pure: :func:`check_loader_policy` is what Preview and the
scheduler's re-check at launch apply.
"""

from __future__ import annotations

from collections.abc import Set

from tuneplane.proto.contract.input_checks import loader_refusal
from tuneplane.proto.contract.jobspec import JobSpec, JobSpecError


def check_loader_policy(spec: JobSpec, loader_env_runtimes: Set[str]) -> None:
    """Refuse a loader variable (``LD_*``, ``PYTHONPATH``, ...) in ``spec.env`` unless the
    coordinator allows them for the JobSpec's runtime.

    ``loader_env_runtimes`` holds the runtime ids coordinator.toml sets ``allow_loader_env = true``
    for. ``spec`` is resolved: an empty ``runtime_id`` has become the recipe's runtime, and a
    JobSpec that still names none matches no runtime and is refused.
    """
    runtime = spec.runtime_id
    refused = loader_refusal(
        spec.env,
        runtime,
        bool(runtime) and runtime in loader_env_runtimes,
        "ask the coordinator's operator to allow them with "
        f'[runtimes."{runtime or "host:<name>"}"] allow_loader_env = true in coordinator.toml '
        "(the Node's node.toml must allow them for that runtime too)",
    )
    if refused is not None:
        name = refused.field.removeprefix("env.")
        raise JobSpecError(refused.field, spec.env[name], refused.why, refused.fix)
