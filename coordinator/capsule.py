"""The Job Capsule the coordinator seals for an attempt: ``capsule.json`` and ``bootstrap.sh``.

Rules:
- Pure: the same attempt gives the same bytes, so every member receives identical files and the
  sha256 digests sent beside them (``capsule_digests``) let each Node verify what it wrote.
- ``runner.pyz`` is not sealed here; each Node writes the runner it ships with into the capsule
  at Prepare (``tuneplane.agent.runner_pyz``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

from tuneplane.proto.contract.jobspec import JobSpec, digest

from .parameters import fill_entrypoint

CAPSULE_JSON = "capsule.json"
BOOTSTRAP_SH = "bootstrap.sh"

BOOTSTRAP = """\
#!/bin/sh
# Job Capsule bootstrap, sealed by the TunePlane coordinator.
# Runs the entrypoint recorded in capsule.json from the member's work directory; the runner sets
# TUNEPLANE_OUT_DIR and the rendezvous variables before it calls this script.
set -eu
exec "$@"
"""


def entrypoint_for(spec: JobSpec) -> list[str]:
    """What every rank execs: the resolved JobSpec's ``command`` (computed at Preview, parameter
    flags included). A JobSpec admitted before ``command`` existed has its entrypoint, with
    ``{parameter}`` placeholders filled, as it always ran."""
    if spec.command:
        return list(spec.command)
    return list(fill_entrypoint(spec.entrypoint, spec.parameters))


def seal(
    spec: JobSpec,
    launcher: str,
    run_id: str,
    attempt: int,
    member_count: int,
    jobspec_digest: str | None = None,
) -> dict[str, str]:
    """The capsule files (name -> text) for one attempt of a Job; ``launcher`` is the recipe's.

    ``jobspec_digest`` is the Job's digest when the caller has it (the scheduler: the admitted
    Job's), so sealing never re-encodes a JobSpec of megabytes; otherwise it is computed.
    """
    capsule = {
        "run_id": run_id,
        "attempt": attempt,
        "member_count": member_count,
        "jobspec_digest": jobspec_digest or digest(spec),
        "method_id": spec.method_id,
        "runtime_id": spec.runtime_id,
        "entrypoint": entrypoint_for(spec),
        "launcher": launcher,
        "gpus_per_member": spec.resources.gpus_per_member,
        "grace_period_s": spec.grace_period_s,
    }
    return {
        CAPSULE_JSON: json.dumps(capsule, sort_keys=True, indent=2) + "\n",
        BOOTSTRAP_SH: BOOTSTRAP,
    }


def digests(files: Mapping[str, str]) -> dict[str, str]:
    """``name -> sha256:<hex>`` of each capsule file's UTF-8 bytes."""
    return {
        name: "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()
        for name, text in files.items()
    }
