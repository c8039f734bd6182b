"""The sans-IO parts of image pulls: manifests and indexes read only when their bytes hash to the
digest that named them, an index resolved to the Node's platform, the cache's plan for every
combination of what is already on disk, and WWW-Authenticate challenges."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tuneplane.agent.image_cache import ImagePlan, plan_image
from tuneplane.agent.image_errors import DigestMismatch, ManifestRefused
from tuneplane.agent.image_manifest import (
    DOCKER_MANIFEST,
    MAX_MANIFEST_BYTES,
    OCI_INDEX,
    OCI_MANIFEST,
    Descriptor,
    ImageConfig,
    Index,
    Manifest,
    Platform,
    read_config,
    read_document,
    select_manifest,
    sha256_hex,
)
from tuneplane.agent.image_pull import Challenge, parse_challenge

LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"


def _desc(n: int, **extra: Any) -> dict[str, Any]:
    return {"mediaType": LAYER, "digest": f"sha256:{f'{n:x}' * 64}"[:71], "size": n, **extra}


def _doc(document: dict[str, Any]) -> tuple[bytes, str]:
    data = json.dumps(document).encode()
    return data, sha256_hex(data)


def test_a_manifest_is_read_when_its_bytes_hash_to_its_digest() -> None:
    data, digest = _doc({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": _desc(1),
                         "layers": [_desc(2), _desc(3)]})  # fmt: skip
    manifest = read_document(data, "", digest, "r.example/a@x")
    assert isinstance(manifest, Manifest)
    assert [d.size for d in manifest.blobs] == [1, 2, 3]
    with pytest.raises(DigestMismatch, match=f"not the sha256:{'0' * 64} it was asked for"):
        read_document(data, "", "0" * 64, "r.example/a@x")


def test_the_content_type_names_a_document_without_a_media_type_field() -> None:
    data, digest = _doc({"schemaVersion": 2, "config": _desc(1), "layers": []})
    assert read_document(data, DOCKER_MANIFEST, digest, "w").media_type == DOCKER_MANIFEST


@pytest.mark.parametrize(
    ("document", "says"),
    [
        ({"schemaVersion": 1, "fsLayers": []}, "Docker schema 1"),
        ({"mediaType": "text/plain"}, "media type 'text/plain'"),
        ({"mediaType": OCI_MANIFEST, "config": _desc(1), "layers": [{"digest": "md5:x"}]},
         "sha256:<64 lowercase hex digits>"),
        ({"mediaType": OCI_MANIFEST, "config": _desc(1) | {"size": -1}, "layers": []},
         "size of 0 or more"),
        ({"mediaType": OCI_MANIFEST, "config": _desc(1), "layers": [_desc(1)] * 1001},
         "more than the 1000"),
        ({"mediaType": OCI_MANIFEST, "config": _desc(1) | {"digest": "sha256:../../etc"},
          "layers": []}, "sha256:<64 lowercase hex digits>"),
    ],
)  # fmt: skip
def test_a_bad_manifest_is_refused_with_a_sentence(document: dict[str, Any], says: str) -> None:
    data, digest = _doc(document)
    with pytest.raises(ManifestRefused) as caught:
        read_document(data, "", digest, "r.example/a@x")
    assert says in str(caught.value) and "r.example/a@x" in str(caught.value)


def test_a_manifest_too_large_is_refused_before_it_is_hashed() -> None:
    with pytest.raises(ManifestRefused, match="more than the"):
        read_document(b" " * (MAX_MANIFEST_BYTES + 1), "", "0" * 64, "w")


def _index(*platforms: str) -> Index:
    manifests = []
    for n, name in enumerate(platforms, 1):
        os_, arch, *variant = name.split("/")
        manifests.append(
            Descriptor(OCI_MANIFEST, f"{n:x}" * 64, n, Platform(os_, arch, "".join(variant)))
        )
    return Index(OCI_INDEX, tuple(manifests))


def test_an_index_resolves_to_the_platform_with_an_exact_variant_first() -> None:
    index = _index("linux/arm64", "linux/arm/v6", "linux/arm/v7", "linux/amd64")
    assert select_manifest(index, Platform("linux", "amd64"), "w").size == 4
    assert select_manifest(index, Platform("linux", "arm", "v7"), "w").size == 3
    assert select_manifest(index, Platform("linux", "arm", "v8"), "w").size == 2
    with pytest.raises(ManifestRefused) as caught:
        select_manifest(index, Platform("linux", "s390x"), "r.example/a@x")
    assert "has no manifest for linux/s390x (it has: linux/arm64, linux/arm/v6" in str(caught.value)


def test_the_config_gives_env_workdir_entrypoint_cmd_and_user() -> None:
    config = {"config": {"Env": ["A=1"], "WorkingDir": "/w", "Entrypoint": None,
                         "Cmd": ["sh"], "User": "app"}}  # fmt: skip
    assert read_config(json.dumps(config).encode(), "w") == ImageConfig(
        ("A=1",), "/w", (), ("sh",), "app"
    )
    assert read_config(b"{}", "w") == ImageConfig()
    with pytest.raises(ManifestRefused, match="Env 'A=1', which is not a list of strings"):
        read_config(json.dumps({"config": {"Env": "A=1"}}).encode(), "w")


def test_a_config_a_member_cannot_start_from_is_refused_at_pull_with_a_sentence() -> None:
    fields = {"Env": ["PATH=/opt/bin:/usr/bin", "A=1=2"], "WorkingDir": None,
              "Entrypoint": ["/entry.sh"], "Cmd": None, "User": "1000:1000"}  # fmt: skip
    config = {"config": fields}
    assert read_config(json.dumps(config).encode(), "r/i@sha256:ab") == ImageConfig(
        env=("PATH=/opt/bin:/usr/bin", "A=1=2"), entrypoint=("/entry.sh",), user="1000:1000"
    )
    refusals = [
        ({"Env": ["JUSTANAME"]}, "Env entry 'JUSTANAME' that is not NAME=value"),
        ({"Env": ["=x"]}, "Env entry '=x' that is not NAME=value"),
        ({"Cmd": "python3 x.py"}, "Cmd 'python3 x.py', which is not a list of strings"),
        ({"WorkingDir": "rel/dir"}, "WorkingDir 'rel/dir', which is not an absolute path"),
        ({"User": 0}, "User 0, which is not a string"),
        (["not", "an", "object"], "a 'config' that is not an object"),
    ]
    for bad, says in refusals:
        with pytest.raises(ManifestRefused) as caught:
            read_config(json.dumps({"config": bad}).encode(), "r/i@sha256:ab")
        assert says in str(caught.value) and "r/i@sha256:ab" in str(caught.value)
        assert "rebuild the image" in str(caught.value)


def test_the_config_round_trips_through_the_cache_record() -> None:
    config = ImageConfig(("A=1",), "/w", ("/e",), ("sh", "-c"), "app")
    assert ImageConfig.from_json(json.loads(json.dumps(config.to_json()))) == config


def _manifest(layer_digests: list[str]) -> Manifest:
    def desc(hex_: str) -> Descriptor:
        return Descriptor(LAYER, hex_ * 64, 1)

    return Manifest(OCI_MANIFEST, desc("c"), tuple(desc(d) for d in layer_digests))


@pytest.mark.parametrize("layers", [["a", "b"], ["a", "a", "b"], []])
def test_the_plan_for_every_state_of_the_disk(layers: list[str]) -> None:
    manifest = _manifest(layers)
    blobs = sorted({d.digest_hex for d in manifest.blobs})
    for have_n in range(len(blobs) + 1):
        for have in itertools.combinations(blobs, have_n):
            for root_ready, record_ready in itertools.product((False, True), repeat=2):
                plan = plan_image(manifest, frozenset(have), root_ready, record_ready)
                if root_ready and record_ready:
                    assert plan == ImagePlan((), unpack=False, write_record=False)
                    continue
                wanted = manifest.blobs if not root_ready else (manifest.config,)
                missing = {d.digest_hex for d in wanted} - set(have)
                fetched = [d.digest_hex for d in plan.fetch]
                assert sorted(fetched) == sorted(missing)  # each missing blob once
                assert plan.unpack == (not root_ready) and plan.write_record


@pytest.mark.parametrize(
    ("header", "challenge"),
    [
        ('Bearer realm="https://auth.example/token",service="registry.example",'
         'scope="repository:team/app:pull"',
         Challenge("bearer", {"realm": "https://auth.example/token",
                              "service": "registry.example",
                              "scope": "repository:team/app:pull"})),
        ('Basic realm="tuneplane-test"', Challenge("basic", {"realm": "tuneplane-test"})),
        ('bearer realm="a, b" , error=insufficient_scope',
         Challenge("bearer", {"realm": "a, b", "error": "insufficient_scope"})),
        ('Bearer realm="say \\"hi\\""', Challenge("bearer", {"realm": 'say "hi"'})),
        ("", Challenge("", {})),
    ],
)  # fmt: skip
def test_challenges_are_parsed(header: str, challenge: Challenge) -> None:
    assert parse_challenge(header) == challenge


@given(st.text(max_size=200))
def test_any_challenge_header_parses_without_raising(header: str) -> None:
    parsed = parse_challenge(header)
    assert parsed.scheme == parsed.scheme.lower()
