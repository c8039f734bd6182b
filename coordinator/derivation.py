"""The Derivation (``--init-from RUN_ID``): the artifact a new run begins from, fixed at Preview.

Rules:
- Pure: :func:`resolve_source` takes what the store knows of the source run (:class:`SourceRun`)
  and the Fleet's ``shared_output_root`` and returns the :class:`InitFromSource` that goes into
  the resolved JobSpec (so the preview digest covers exactly which bytes the run starts from),
  or raises :class:`~tuneplane.coordinator.jobspec.JobSpecError` on field ``init_from`` with a
  sentence naming the run and why.
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
  manifest at ``out_dir + MANIFEST_SUFFIX``, whose sha256 must be ``manifest_sha256``
  (:mod:`tuneplane.agent.init_from`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import posixpath
import re
from typing import Any

import attrs

#: The manifest of a member's output directory ``<out_dir>`` is the file ``<out_dir>`` + this,
#: beside it in the root-owned attempt directory, where the workload cannot write.
MANIFEST_SUFFIX = ".manifest.json"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def manifest_path(out_dir: str) -> str:
    """Where the manifest of the output directory ``out_dir`` lies."""
    return out_dir + MANIFEST_SUFFIX


@attrs.frozen
class ManifestSummary:
    """What a Node reports about one member's output manifest when the member ends.

    ``problem`` is a sentence when no manifest could be written (too many files, too many bytes,
    an unreadable directory); ``files``, ``bytes`` and ``sha256`` are then 0 and "".
    """

    files: int = 0
    bytes: int = 0
    sha256: str = ""
    problem: str = ""

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self), sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> ManifestSummary | None:
        """The summary stored as ``text``; None for "" (none reported) or text it cannot read."""
        if not text:
            return None
        try:
            raw: Any = json.loads(text)
            return ManifestSummary(
                int(raw.get("files", 0)),
                int(raw.get("bytes", 0)),
                str(raw.get("sha256", "")),
                str(raw.get("problem", "")),
            )
        except (ValueError, TypeError, AttributeError):
            return None


def check_summary(summary: ManifestSummary) -> str | None:
    """Why a Node's reported summary cannot be stored as it is, or None when it is well formed."""
    if summary.problem:
        if summary.sha256 or summary.files or summary.bytes:
            return "an output manifest with a problem must report no files, bytes or digest"
        if len(summary.problem) > 1000:
            return "an output manifest problem must be at most 1000 characters"
        return None
    if not _SHA256.fullmatch(summary.sha256):
        return "an output manifest digest must be 64 lowercase hex digits (sha256)"
    if summary.files < 0 or summary.bytes < 0:
        return "an output manifest cannot count negative files or bytes"
    return None


@attrs.frozen
class InitFromSource:
    """The artifact a Derivation begins from, as the resolved JobSpec carries it to every Node."""

    run_id: str
    attempt: int
    member_index: int
    out_dir: str
    manifest_sha256: str
    files: int
    bytes: int
    # The Node that holds ``out_dir`` on its own disk, for a source that is not on the Fleet's
    # shared output root: the target Node fetches it from there (agent/outputs_fetch.py). ""
    # when every Node of the Fleet reads ``out_dir`` itself (absent from the canonical JSON then,
    # so a JobSpec resolved before the field existed keeps its digest).
    node_id: str = ""


# --- fetch grants: what lets one Node fetch another's outputs --------------------------------

#: How long a grant made when a Prepare is sent stays good. A Prepare resent later carries a
#: fresh one, so this only has to cover one Prepare's copy.
GRANT_TTL_MS = 30 * 60 * 1000
GRANT_KEY_BYTES = 32
_GRANT_CONTEXT = b"tuneplane outputs grant v1\x00"


def grant_message(run_id: str, attempt: int, member_index: int, expires_at_ms: int) -> bytes:
    """The bytes a grant signs: the source member and the expiry, unambiguously separated."""
    return _GRANT_CONTEXT + "\x00".join(
        (run_id, str(int(attempt)), str(int(member_index)), str(int(expires_at_ms)))
    ).encode("utf-8")


def make_grant(key: bytes, run_id: str, attempt: int, member_index: int, expires_at_ms: int) -> str:
    """The grant (hex) that lets its bearer fetch the outputs of one source member from the
    Node whose grant key is ``key``, until ``expires_at_ms``."""
    if len(key) != GRANT_KEY_BYTES:
        raise ValueError(f"a grant key is {GRANT_KEY_BYTES} bytes, not {len(key)}")
    return hmac.new(
        key, grant_message(run_id, attempt, member_index, expires_at_ms), hashlib.sha256
    ).hexdigest()


def grant_valid(
    key: bytes,
    grant: str,
    run_id: str,
    attempt: int,
    member_index: int,
    expires_at_ms: int,
    now_ms: int,
) -> bool:
    """Whether ``grant`` is the holder's own for that member and has not expired at ``now_ms``
    (compared in constant time)."""
    if now_ms >= expires_at_ms or len(key) != GRANT_KEY_BYTES:
        return False
    expected = make_grant(key, run_id, attempt, member_index, expires_at_ms)
    return hmac.compare_digest(expected, grant)


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
    # Imported here: jobspec imports this module for InitFromSource.
    from tuneplane.coordinator.jobspec import JobSpecError

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
