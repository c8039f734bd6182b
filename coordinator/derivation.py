"""The Derivation (``--init-from RUN_ID``): the artifact a new run begins from, fixed at Preview.

Rules:
- Pure: :func:`resolve_source` takes what the store knows of the source run (:class:`SourceRun`)
  and the Fleet's ``shared_output_root`` and returns the :class:`InitFromSource` that goes into
  the resolved JobSpec (so the preview digest covers exactly which bytes the run starts from),
  or raises :class:`~tuneplane.proto.contract.jobspec.JobSpecError` on field ``init_from`` with a
  sentence naming the run and why. What the JobSpec carries, and what a Node reports of its
  outputs, are the protocol's contract (:mod:`tuneplane.proto.contract.derivation_source`).
- The source must exist, be readable by the caller (the rule of ``tp job show``,
  :mod:`.job_access`), have succeeded, and its member 0 of the attempt that succeeded must have
  an output manifest (its Node writes one when the member ends,
  :mod:`tuneplane.agent.outputs_manifest`).
  Member 0's outputs are the artifact: with data-parallel training every rank saves the same
  weights and rank 0 writes the checkpoint.
- Where the Nodes get it from is fixed at Preview too. An artifact under the target Fleet's
  ``shared_output_root`` (a directory every Node of the Fleet mounts at that path and uses as its
  output root) is copied from there (``node_id`` ""). Any other is fetched from the Node that
  holds it (``node_id`` is that Node): refused, saying so, when that Node serves no outputs
  (its ``[outputs] listen`` is off, or its agent predates it), was declared lost, or is revoked.
- The Node copies ``out_dir`` at Prepare, locally or over the holder's outputs listener with
  the grant its Prepare carries (:mod:`.outputs_grants`), and verifies every file against the
  manifest at ``manifest_path(out_dir)``, whose sha256 must be ``manifest_sha256``
  (:mod:`tuneplane.agent.init_from`).
- Shown back (``tp submit --preview``, the console's Job page) from the resolved JobSpec alone:
  :func:`stored_source` reads it, :func:`how_fetched` says where the Nodes got it.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping
from typing import Any

import attrs

from tuneplane.proto.contract.derivation_source import (
    InitFromSource,
    ManifestSummary,
    check_summary,
)
from tuneplane.proto.contract.jobspec import JobSpecError

#: How long a grant made when a Prepare is sent stays good (the grant itself:
#: :mod:`tuneplane.proto.contract.outputs_grant`). A Prepare resent later carries a fresh one, so
#: this only has to cover one Prepare's copy.
GRANT_TTL_MS = 30 * 60 * 1000


@attrs.frozen
class Holder:
    """What the store knows of the Node that ran a source's member 0 (and holds its outputs)."""

    node_id: str
    name: str
    # Where it serves outputs to other Nodes, as its last Hello said; "" when it serves none.
    outputs_address: str = ""
    # Declared lost (and not connected since), or revoked (its credential retired for good).
    lost: bool = False
    retired: bool = False


@attrs.frozen
class SourceRun:
    """What the store knows of the run an ``--init-from`` names."""

    run_id: str
    state: str
    readable: bool
    owner: str
    # The attempt that ran last (the one that succeeded, for a succeeded run) and its member 0.
    attempt: int = 0
    out_dir: str = ""
    node: str = ""
    manifest: ManifestSummary | None = None
    # The Node member 0 ran on; None when the store has no such Node.
    holder: Holder | None = None


def _refuse(run_id: str, why: str, fix: str) -> Exception:
    return JobSpecError("init_from", run_id, why, fix)


def _under(path: str, root: str) -> bool:
    clean = posixpath.normpath(path)
    return clean == path and (root == "/" or clean.startswith(root.rstrip("/") + "/"))


def resolve_source(
    run_id: str, source: SourceRun | None, fleet: str, shared_output_root: str
) -> InitFromSource:
    """The artifact ``--init-from run_id`` begins from on ``fleet``, or a JobSpecError saying why
    there is none. ``source`` is None when no Job has that run id."""
    if source is None:
        raise _refuse(
            run_id,
            f"there is no run {run_id}",
            "Copy the run id of a succeeded Job from `tp job ls --state succeeded`.",
        )
    if not source.readable:
        raise _refuse(
            run_id,
            f"the run {run_id} belongs to {source.owner} and is not shared with you, so it "
            "cannot be your run's source",
            f"Ask {source.owner} to add you to share_with in their project's tuneplane.yaml, "
            "or begin from one of your own runs.",
        )
    if source.state != "succeeded":
        raise _refuse(
            run_id,
            f"the run {run_id} is {source.state}, and only a succeeded run's outputs can be a "
            "source",
            f"Wait for it to succeed (`tp job show {run_id} --watch`) or pick a succeeded run.",
        )
    where = f"member 0 of attempt {source.attempt}"
    summary = source.manifest
    if summary is None:
        raise _refuse(
            run_id,
            f"the run {run_id}'s {where} has no output manifest (its Node reported none when "
            "the member ended, as a Node older than output manifests does)",
            "Run it again on Nodes that write manifests, then begin from that run.",
        )
    if summary.problem:
        raise _refuse(
            run_id,
            f"the run {run_id}'s {where} has no output manifest: {summary.problem.rstrip('.')}",
            "Keep the outputs within the manifest's bounds (docs/researcher.md, \"Starting from "
            'another run") and run it again.',
        )
    if shared_output_root and _under(source.out_dir, shared_output_root):
        node_id = ""
    else:
        node_id = _fetch_holder(run_id, source, fleet, shared_output_root).node_id
    return InitFromSource(
        run_id=run_id,
        attempt=source.attempt,
        member_index=0,
        out_dir=source.out_dir,
        manifest_sha256=summary.sha256,
        files=summary.files,
        bytes=summary.bytes,
        node_id=node_id,
    )


def _fetch_holder(run_id: str, source: SourceRun, fleet: str, shared_output_root: str) -> Holder:
    """The Node a source that is not on ``fleet``'s shared output root is fetched from, or the
    refusal saying why it cannot be."""
    where = (
        f"not under the Fleet {fleet}'s shared output root {shared_output_root}"
        if shared_output_root
        else f"on one Node's disk (the Fleet {fleet} declares no shared_output_root)"
    )
    if not source.out_dir.startswith("/") or posixpath.normpath(source.out_dir) != source.out_dir:
        raise _refuse(
            run_id,
            f"the run {run_id}'s member 0 reported the output directory {source.out_dir!r}, "
            "which is not an absolute, normalised path, so no Node can fetch it",
            "Run the source again on a Node with a current agent.",
        )
    holder = source.holder
    if holder is None:
        raise _refuse(
            run_id,
            f"the run {run_id}'s outputs ({source.out_dir}) are {where}, and the Node "
            f"{source.node} that holds them is no longer enrolled, so nothing can fetch them",
            "Run the source again, then begin from that run.",
        )
    named = f"Node {holder.name} ({holder.node_id})"
    if holder.retired:
        raise _refuse(
            run_id,
            f"the run {run_id}'s outputs ({source.out_dir}) are {where}, held by {named}, "
            "whose credential was revoked, so it no longer connects and cannot serve them",
            f"Re-enroll {named} (docs/operator.md) and preview again, or run the source again "
            "on another Node.",
        )
    if holder.lost:
        raise _refuse(
            run_id,
            f"the run {run_id}'s outputs ({source.out_dir}) are {where}, held by {named}, "
            "which was declared lost, so nothing can fetch them",
            f"Bring {named} back (it serves them again once it reconnects) and preview again, "
            "or run the source again on another Node.",
        )
    if not holder.outputs_address:
        raise _refuse(
            run_id,
            f"the run {run_id}'s outputs ({source.out_dir}) are {where}, held by {named}, "
            'which serves no outputs to other Nodes (its node.toml sets [outputs] listen = "", '
            "or its agent is older than outputs listeners)",
            f"Ask the operator of {named} to turn its outputs listener on ([outputs] listen in "
            f"node.toml) and restart tuneplane-node, or to declare [fleet.{fleet}] "
            "shared_output_root, then preview again.",
        )
    return holder


def stored_manifest(summary: ManifestSummary) -> ManifestSummary:
    """What the coordinator records of a reported summary: itself when well formed, else a
    problem saying so (such a member cannot seed a Derivation)."""
    problem = check_summary(summary)
    if problem is None:
        return summary
    return ManifestSummary(problem=f"its Node reported a malformed output manifest: {problem}.")


def stored_source(resolved_jobspec_json: str) -> InitFromSource | None:
    """The Derivation's source as the resolved JobSpec (JSON text) carries it; None without
    one, or when it cannot be read (a value of the wrong type, a field missing)."""
    try:
        src: Any = json.loads(resolved_jobspec_json).get("init_from_source")
        if not isinstance(src, dict) or not isinstance(src.get("node_id", ""), str):
            return None
        return InitFromSource(
            run_id=str(src["run_id"]),
            attempt=int(src["attempt"]),
            member_index=int(src["member_index"]),
            out_dir=str(src.get("out_dir", "")),
            manifest_sha256=str(src["manifest_sha256"]),
            files=int(src["files"]),
            bytes=int(src["bytes"]),
            node_id=src.get("node_id", ""),
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def how_fetched(source: InitFromSource, node_names: Mapping[str, str] | None = None) -> str:
    """Where each Node got the source at Prepare, in words: fetched from the Node that holds it
    (named from ``node_names``, node id -> display name, when it is there) or copied from the
    Fleet's shared output root."""
    if not source.node_id:
        return "copied from the shared output root at Prepare"
    name = (node_names or {}).get(source.node_id, "")
    node = f"{name} ({source.node_id})" if name and name != source.node_id else source.node_id
    return f"fetched from Node {node} at Prepare"
