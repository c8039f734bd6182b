"""What a Derivation (``--init-from RUN_ID``) carries between the coordinator and the Nodes.

Rules:
- :class:`InitFromSource` is the source artifact as the resolved JobSpec carries it to every
  Node: the coordinator fills it at Preview (:mod:`tuneplane.coordinator.derivation`), so the
  preview digest covers exactly which bytes a run begins from, and the Node copies and verifies
  it at Prepare (:mod:`tuneplane.agent.init_from`).
- :class:`ManifestSummary` is what a Node reports of one member's output manifest when the member
  ends (:mod:`tuneplane.agent.outputs_manifest`); :func:`check_summary` is the one rule for its
  form, which the coordinator applies before storing it.
- The manifest of an output directory ``<out_dir>`` lies at :func:`manifest_path`, beside it.
- Part of the protocol's contract (:mod:`tuneplane.proto.contract`): pure, and imports nothing
  from the coordinator, the agent, the collector or the runner.
"""

from __future__ import annotations

import json
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
