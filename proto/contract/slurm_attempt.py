"""The contract between the coordinator and the Slurm step (``python -m
tuneplane.agent.slurm_step``): one attempt's folder on a Fleet's shared folder, and the
``attempt.json`` the coordinator writes there before it submits the Slurm job.

Rules: pure (paths and JSON only). The coordinator writes the folder and ``attempt.json``
(atomically); the step on each Slurm node writes only inside its own member folder.
Layout, under the Fleet's shared folder::

    <run id>/attempt-<n>/attempt.json          what to run (this module's AttemptFile)
    <run id>/attempt-<n>/slurm-<job id>.out    the batch script's own output (srun's words)
    <run id>/attempt-<n>/member-<i>/           member i (the node with SLURM_NODEID i), in the
                                               Slurm job's first run:
        work/ (experiment files, capsule)  out/ ($TUNEPLANE_OUT_DIR)  stdout.log  stderr.log,
        the runner's member.json, runner.json, exit.json, and collector.credential (0600,
        written by the coordinator), ca.pem and collector.log for its collector
    <run id>/attempt-<n>/restart-<r>/member-<i>/   member i in the job's run r + 1, once Slurm
                                               requeued it r times (SLURM_RESTART_COUNT r >= 1):
        the same files but collector.credential, which stays in the first run's member folder
        and is read from there (it names the member, not the run)

Each run of the Slurm job has its own member folders (:func:`member_dir`), so a run Slurm starts
again after a requeue claims a launch of its own, and the folders of the runs before it stay as
they ended. A member's ``stdout.log`` (and ``stderr.log``) is the concatenation of its runs'
files in restart order; its collector ships a requeued run's points under source ids that start
with ``restart-<r>/`` (:func:`source_prefix`), so they are stored beside the first run's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

ATTEMPT_FILE = "attempt.json"
FORMAT = 1


class AttemptFileError(ValueError):
    """``attempt.json`` cannot be read; the message names the field and the fix."""


def attempt_dir(shared_dir: str | Path, run_id: str, attempt: int) -> Path:
    return Path(shared_dir) / run_id / f"attempt-{attempt}"


def member_dir(attempt_folder: Path, member_index: int, restart: int = 0) -> Path:
    """Member ``member_index``'s folder in the Slurm job's run after ``restart`` requeues:
    ``member-<i>/`` in the attempt's folder for the first run, ``restart-<r>/member-<i>/`` for
    a later one."""
    if restart < 0:
        raise ValueError(f"a restart count is 0 or more, not {restart}")
    run = attempt_folder if restart == 0 else attempt_folder / f"restart-{restart}"
    return run / f"member-{member_index}"


def source_prefix(restart: int) -> str:
    """What a member's collector puts in front of its source ids in the run after ``restart``
    requeues: "" in the first run (the files' paths, as on a Node), ``restart-<r>/`` after."""
    return "" if restart == 0 else f"restart-{restart}/"


CREDENTIAL_FILE = "collector.credential"


def job_name(run_id: str, attempt: int) -> str:
    """The Slurm job name of an attempt: the idempotency key of its submission."""
    return f"tp-{run_id}-a{attempt}"


@attrs.frozen
class AttemptFile:
    """What every member of a Slurm attempt runs, as the coordinator sealed it: the resolved
    JobSpec (experiment files and env in it) and the Job Capsule's files."""

    run_id: str
    attempt: int
    member_count: int
    gpus_per_member: int
    jobspec_json: str
    capsule: Mapping[str, str]  # file name -> text (capsule.json, bootstrap.sh)
    # file name -> ``sha256:<hex>`` as the coordinator sealed them: a node checks what it read
    # from the shared folder against them, as a Node checks a Prepare's capsule.
    capsule_digests: Mapping[str, str] = attrs.field(factory=dict)
    # Where each member's collector ships (the telemetry gateway, then its fallbacks) and the
    # CA (PEM) that signed its certificate; no gateways: no collector.
    gateways: tuple[str, ...] = ()
    ca_pem: str = ""
    # The folder on the node's own storage for the collector's spool ("": its temporary folder).
    spool_dir: str = ""
    # For an image runtime: the folder on each node's own storage where the step caches images
    # ("": the Fleet runs no images), and the node's TOML file saying how it reaches registries
    # (node.toml's [registries."host:port"] tables; "": the system's CAs, no credentials).
    image_root: str = ""
    registries_file: str = ""

    def to_json(self) -> str:
        body = attrs.asdict(self)
        body["capsule"] = dict(self.capsule)
        body["capsule_digests"] = dict(self.capsule_digests)
        body["gateways"] = list(self.gateways)
        return json.dumps({"format": FORMAT, **body}, sort_keys=True) + "\n"


def read_attempt_file(folder: Path) -> AttemptFile:
    """Read ``<folder>/attempt.json``; :class:`AttemptFileError` with a sentence otherwise."""
    path = folder / ATTEMPT_FILE
    try:
        raw: Any = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise AttemptFileError(
            f"{path} cannot be read ({exc}); the coordinator writes it before it submits the "
            "Slurm job: check that this node mounts the Fleet's shared folder at that path."
        ) from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise AttemptFileError(f"{path} is not an attempt file of format {FORMAT}.")
    try:
        return AttemptFile(
            run_id=str(raw["run_id"]),
            attempt=int(raw["attempt"]),
            member_count=int(raw["member_count"]),
            gpus_per_member=int(raw["gpus_per_member"]),
            jobspec_json=str(raw["jobspec_json"]),
            capsule={str(k): str(v) for k, v in dict(raw["capsule"]).items()},
            capsule_digests={str(k): str(v) for k, v in dict(raw["capsule_digests"]).items()},
            gateways=tuple(str(g) for g in raw.get("gateways") or ()),
            ca_pem=str(raw.get("ca_pem") or ""),
            spool_dir=str(raw.get("spool_dir") or ""),
            image_root=str(raw.get("image_root") or ""),
            registries_file=str(raw.get("registries_file") or ""),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise AttemptFileError(f"{path} lacks or garbles the field {exc}.") from None
