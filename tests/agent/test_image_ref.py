"""Runtime image references: every well-formed reference round-trips, anything else is an
ImageRefError whose sentence names what is wrong (never another exception)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tuneplane.agent.image_ref import (
    ImageRef,
    ImageRefError,
    TaggedImage,
    parse_image_ref,
    parse_tagged_image,
)

HEX = "0123456789abcdef" * 4

_component = st.from_regex(r"\A[a-z0-9]{1,6}(?:(?:\.|_|__|-{1,2})[a-z0-9]{1,6}){0,2}\Z")
names = st.lists(_component, min_size=1, max_size=4).map("/".join)
_label = st.from_regex(r"\A[a-z0-9](?:[a-z0-9-]{0,10}[a-z0-9])?\Z")
hosts = st.one_of(
    st.just("localhost"),
    st.lists(_label, min_size=2, max_size=4).map(".".join),
    st.ip_addresses(v=4).map(str),
    st.ip_addresses(v=6).map(lambda ip: f"[{ip}]"),
)
registries = st.tuples(hosts, st.none() | st.integers(1, 65535)).map(
    lambda hp: hp[0] if hp[1] is None else f"{hp[0]}:{hp[1]}"
)
digests = st.text("0123456789abcdef", min_size=64, max_size=64)
tags = st.from_regex(r"\A[A-Za-z0-9_][A-Za-z0-9._-]{0,20}\Z")


@given(registries, names, digests, st.booleans())
def test_a_pinned_reference_round_trips(
    registry: str, name: str, digest: str, prefixed: bool
) -> None:
    text = f"{'image:' if prefixed else ''}{registry}/{name}@sha256:{digest}"
    ref = parse_image_ref(text)
    assert ref == ImageRef(registry, name, digest)
    assert ref.digest == f"sha256:{digest}"
    assert str(ref) == text if prefixed else str(ref) == f"image:{text}"
    assert parse_image_ref(str(ref)) == ref


@given(registries, names, tags, digests)
def test_a_tagged_reference_round_trips_and_pins(
    registry: str, name: str, tag: str, digest: str
) -> None:
    tagged = parse_tagged_image(f"{registry}/{name}:{tag}")
    assert tagged == TaggedImage(registry, name, tag)
    assert parse_tagged_image(str(tagged)) == tagged
    assert tagged.pinned(digest) == ImageRef(registry, name, digest)


@given(st.text(max_size=80))
def test_any_text_parses_or_is_refused_with_a_sentence(text: str) -> None:
    for parse in (parse_image_ref, parse_tagged_image):
        try:
            ref = parse(text)
        except ImageRefError as exc:
            message = str(exc)
            assert repr(text) in message and message.endswith(".")
        else:
            assert parse(str(ref)) == ref


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("image:registry.example/team/pytorch:2.4", "resolve the tag '2.4' at Preview"),
        ("image:library/ubuntu@sha256:" + HEX, "'library', which is not a registry"),
        ("image:pytorch@sha256:" + HEX, "does not start with a registry"),
        ("image:registry.example/Team@sha256:" + HEX, "repository name 'Team'"),
        ("image:registry.example/team@sha512:" + HEX, "sha256 only"),
        ("image:registry.example/team@sha256:" + HEX[:-1], "not 64 lowercase hex digits"),
        ("image:registry.example/team@sha256:" + HEX.upper(), "not 64 lowercase hex digits"),
        ("image:registry.example:0/team@sha256:" + HEX, "registry port '0'"),
        ("image:registry.example:99999/team@sha256:" + HEX, "registry port '99999'"),
        ("image:[::1/team@sha256:" + HEX, "'[::1', which is not a registry"),
        ("image:registry.example/" + "a" * 250 + "@sha256:" + HEX, "longer than 255"),
    ],
)
def test_a_bad_pinned_reference_says_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ImageRefError, match=None) as caught:
        parse_image_ref(text)
    assert says in str(caught.value)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("registry.example/team/pytorch", "names no tag"),
        ("localhost:5000/team", "names no tag"),
        ("registry.example/team:.hidden", "the tag '.hidden'"),
        ("registry.example/team@sha256:" + HEX, "has a digest"),
    ],
)
def test_a_bad_tagged_reference_says_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ImageRefError) as caught:
        parse_tagged_image(text)
    assert says in str(caught.value)
