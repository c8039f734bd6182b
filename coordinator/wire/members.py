"""What every boundary says about a member: its reference and its output manifest.

Rules: a reference without a run id is a :class:`~.errors.BadMessage` from a peer the server
does not trust (a Node, a collector), and read as it is from a server's reply; an output manifest
without a digest or a problem is none at all (None), the wire's unset value.
"""

from __future__ import annotations

from tuneplane.proto import v1
from tuneplane.proto.contract.derivation_source import ManifestSummary

from ..values.jobs import MemberKey
from .errors import BadMessage


def member_key(ref: v1.MemberRef | None) -> MemberKey:
    if ref is None or not ref.run_id:
        raise BadMessage("the message names no member (member.run_id is empty).")
    return MemberKey(ref.run_id, ref.attempt, ref.member_index)


def member_key_as_sent(ref: v1.MemberRef | None) -> MemberKey:
    """A member a server's reply names, read as it is (``tp`` shows what the coordinator said;
    a reply is never refused for it)."""
    ref = ref or v1.MemberRef()
    return MemberKey(ref.run_id, ref.attempt, ref.member_index)


def member_ref(key: MemberKey) -> v1.MemberRef:
    return v1.MemberRef(run_id=key.run_id, attempt=key.attempt, member_index=key.member_index)


def manifest_from_wire(msg: v1.OutputManifest | None) -> ManifestSummary | None:
    """A member's output manifest; None when the message carries none (a manifest always has
    a digest or a problem)."""
    if msg is None or not (msg.sha256 or msg.problem):
        return None
    return ManifestSummary(msg.files, msg.bytes, msg.sha256, msg.problem)


def manifest_to_wire(summary: ManifestSummary | None) -> v1.OutputManifest:
    """A member's output manifest; empty when its Node reported none."""
    if summary is None:
        return v1.OutputManifest()
    return v1.OutputManifest(
        files=summary.files, bytes=summary.bytes, sha256=summary.sha256, problem=summary.problem
    )
