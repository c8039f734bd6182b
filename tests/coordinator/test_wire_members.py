"""What every boundary says about a member (coordinator/wire/members.py): its reference and its
output manifest come back equal from the wire; a peer's message that names no member is
refused, a server's reply that names none is read as it is."""

from __future__ import annotations

import pytest
from hypothesis import given

from tests.support import value_strategies as vs
from tuneplane.coordinator.values.jobs import MemberKey
from tuneplane.coordinator.wire.errors import BadMessage
from tuneplane.coordinator.wire.members import (
    manifest_from_wire,
    manifest_to_wire,
    member_key,
    member_key_as_sent,
    member_ref,
)
from tuneplane.proto import v1
from tuneplane.proto.contract.derivation_source import ManifestSummary

pytestmark = pytest.mark.timeout(60)


@given(vs.member_keys)
def test_a_member_reference_comes_back_equal(key: MemberKey) -> None:
    ref = v1.MemberRef().parse(bytes(member_ref(key)))
    assert member_key(ref) == key == member_key_as_sent(ref)


@given(vs.manifests)
def test_an_output_manifest_comes_back_equal(manifest: ManifestSummary | None) -> None:
    msg = v1.OutputManifest().parse(bytes(manifest_to_wire(manifest)))
    assert manifest_from_wire(msg) == manifest


def test_a_peer_s_message_that_names_no_member_is_refused_with_a_sentence() -> None:
    for ref in (None, v1.MemberRef(), v1.MemberRef(attempt=1, member_index=2)):
        with pytest.raises(BadMessage, match=r"the message names no member \(member\.run_id"):
            member_key(ref)


def test_a_reply_that_names_no_member_is_read_as_it_is() -> None:
    assert member_key_as_sent(None) == MemberKey("", 0, 0)
    assert member_key_as_sent(v1.MemberRef(attempt=2)) == MemberKey("", 2, 0)


def test_a_manifest_with_neither_a_digest_nor_a_problem_is_none() -> None:
    assert manifest_from_wire(v1.OutputManifest(files=3, bytes=10)) is None
    assert manifest_from_wire(None) is None
