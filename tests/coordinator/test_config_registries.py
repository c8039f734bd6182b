"""``[fleet.<name>.registries."<host[:port]>"]`` in coordinator.toml: what it reads, and a sentence
naming the key and the fix for each mistake; and the pure half of pinning (the form of an image
runtime, and the Fleet's registry) that admission applies before any network I/O."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.coordinator.grpc_client import jobspec
from tuneplane.coordinator.admission import admit
from tuneplane.coordinator.catalogue import Catalogue
from tuneplane.coordinator.config import DEFAULT_CONFIG, ConfigError, parse_config
from tuneplane.coordinator.config.values import DEFAULT_REGISTRY_TIMEOUT_S, RegistrySettings
from tuneplane.proto.contract import jobspec as js

PATH = Path("/etc/tuneplane/coordinator.toml")
REGISTRY = '[fleet.default.registries."registry.example.org:5000"]\n'
DIGEST = "ab" * 32
pytestmark = pytest.mark.sqlite_only("pure: no store")


def _parse(extra: str) -> dict[str, RegistrySettings]:
    config = parse_config(DEFAULT_CONFIG + "\n" + extra, PATH)
    return dict(config.fleets["default"].registries)


def test_a_registry_entry_reads_every_key() -> None:
    found = _parse(
        REGISTRY + 'ca_file = "/etc/tuneplane/registry-ca.pem"\nusername = "tp"\n'
        'password_file = "/etc/tuneplane/registry.password"\ntimeout_s = 4\n'
        '[fleet.default.registries."localhost"]\n'
    )
    assert found["registry.example.org:5000"] == RegistrySettings(
        "registry.example.org:5000",
        Path("/etc/tuneplane/registry-ca.pem"),
        "tp",
        Path("/etc/tuneplane/registry.password"),
        4.0,
    )
    assert found["localhost"] == RegistrySettings("localhost")
    assert found["localhost"].timeout_s == DEFAULT_REGISTRY_TIMEOUT_S


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ('[fleet.default.registries."library"]\n', "does not name a registry"),
        ('[fleet.default.registries."reg.example/x"]\n', "does not name a registry"),
        (REGISTRY + "cafile = '/x'\n", "unknown key(s) cafile"),
        (REGISTRY + "ca_file = 'relative.pem'\n", "ca_file = 'relative.pem' must be an absolute"),
        (REGISTRY + "username = 'tp'\n", "has username but no password_file"),
        (REGISTRY + "password_file = '/p'\n", "has password_file but no username"),
        (REGISTRY + "username = 'a:b'\npassword_file = '/p'\n", "without ':'"),
        (REGISTRY + "timeout_s = 0\n", "timeout_s = 0 must be a number of seconds above 0"),
        (REGISTRY + "timeout_s = 61\n", "at most 60"),
        (REGISTRY + "timeout_s = true\n", "timeout_s = True"),
        ("[fleet.default]\nregistries = 3\n", "fleet.default.registries must hold tables"),
    ],
)
def test_a_mistake_is_a_sentence_naming_the_key(extra: str, says: str) -> None:
    with pytest.raises(ConfigError) as error:
        _parse(extra)
    assert str(error.value).startswith(f"{PATH}: ")
    assert says in str(error.value)


def _admit(runtime_id: str, extra: str = "") -> str:
    spec = jobspec(gpus=0, profile="cpu")
    spec["runtime_id"] = runtime_id
    config = parse_config(DEFAULT_CONFIG + "\n" + extra, PATH)
    admitted = admit(json.dumps(spec), config, Catalogue.bundled())
    return admitted.runtime_id


def test_admission_refuses_an_image_runtime_it_cannot_read() -> None:
    for bad in ("image:pytorch:2.4", "image:registry.example.org/Team/x:1",
                "image:registry.example.org/x@sha256:1234"):  # fmt: skip
        with pytest.raises(js.JobSpecError) as error:
            _admit(bad, REGISTRY)
        assert error.value.field == "runtime_id"
        assert "is not an image TunePlane can run" in str(error.value)


def test_admission_refuses_an_image_from_a_registry_the_fleet_does_not_list() -> None:
    with pytest.raises(js.JobSpecError) as error:
        _admit(f"image:other.example.org/x@sha256:{DIGEST}", REGISTRY)
    message = str(error.value)
    assert error.value.field == "runtime_id"
    assert "the Fleet 'default' (chosen by resources.profile) does not list" in message
    assert "(it lists: registry.example.org:5000)" in message
    assert '[fleet.default.registries."other.example.org"]' in message
    # No entry at all: "none".
    with pytest.raises(js.JobSpecError, match=r"it lists: none"):
        _admit("image:registry.example.org:5000/x:1")


def test_admission_passes_a_listed_image_and_host_runtimes_as_they_are() -> None:
    tagged = "image:registry.example.org:5000/team/x:2.4"
    assert _admit(tagged, REGISTRY) == tagged  # pinned later, by Preview, over the network
    assert _admit("") == "host:bash"  # the recipe's runtime
