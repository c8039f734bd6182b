"""The Derivation's rules, pure: which run may seed a new one, where the Nodes get it (the
Fleet's shared output root, or fetched from the Node that holds it), and the sentence when it may
not; the resolved JobSpec carries the source (its digest covers it) and an intent may not set
it."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tuneplane.coordinator.config import DEFAULT_CONFIG, ConfigError, load_config
from tuneplane.coordinator.derivation import Holder, SourceRun, resolve_source, stored_manifest
from tuneplane.proto.contract.derivation_source import InitFromSource, ManifestSummary
from tuneplane.proto.contract.jobspec import JobSpecError, canonical_json, loads

pytestmark = pytest.mark.timeout(30)

SHA = "ab" * 32
ROOT = "/mnt/tp-out"
HOLDER = Holder("node-1", "gpu-a", "10.0.0.1:7463")
GOOD = SourceRun(
    "run-a", "succeeded", True, "alice", 1, f"{ROOT}/run-a/attempt-1/member-0", "gpu-a",
    ManifestSummary(2, 1234, SHA), HOLDER,
)  # fmt: skip


def test_a_succeeded_readable_run_under_the_shared_root_is_the_source() -> None:
    source = resolve_source("run-a", GOOD, "default", ROOT)
    assert source == InitFromSource("run-a", 1, 0, GOOD.out_dir, SHA, 2, 1234)
    # On the shared root the holder is not asked: every Node reads it there, serving or not.
    quiet = attrs.evolve(GOOD, holder=attrs.evolve(HOLDER, outputs_address="", lost=True))
    assert resolve_source("run-a", quiet, "default", ROOT).node_id == ""


@pytest.mark.parametrize("root", ["", "/mnt/other"])
def test_a_source_off_the_shared_root_is_fetched_from_its_holder(root: str) -> None:
    source = resolve_source("run-a", GOOD, "default", root)
    assert source == InitFromSource("run-a", 1, 0, GOOD.out_dir, SHA, 2, 1234, node_id="node-1")
    # The holder travels in the resolved JobSpec, so the preview digest covers it.
    assert '"node_id":"node-1"' in canonical_json(
        loads(_spec_json(init_from="run-a", init_from_source=attrs.asdict(source)))
    )


@pytest.mark.parametrize(
    ("found", "root", "said"),
    [
        (None, ROOT, "there is no run run-a"),
        (SourceRun("run-a", "", False, "bob"), ROOT, "belongs to bob and is not shared with you"),
        (attrs.evolve(GOOD, state="failed"), ROOT, "the run run-a is failed, and only a succeeded"),
        (attrs.evolve(GOOD, manifest=None), ROOT, "has no output manifest (its Node reported"),
        (
            attrs.evolve(GOOD, manifest=ManifestSummary(problem="it holds more than 10 files")),
            ROOT,
            "has no output manifest: it holds more than 10 files",
        ),
        (
            attrs.evolve(GOOD, holder=attrs.evolve(HOLDER, outputs_address="")),
            "",
            "are on one Node's disk (the Fleet default declares no shared_output_root), held by "
            "Node gpu-a (node-1), which serves no outputs to other Nodes",
        ),
        (
            attrs.evolve(GOOD, holder=attrs.evolve(HOLDER, outputs_address="")),
            "/mnt/other",
            "are not under the Fleet default's shared output root /mnt/other, held by Node gpu-a "
            "(node-1), which serves no outputs",
        ),
        (
            attrs.evolve(GOOD, holder=attrs.evolve(HOLDER, lost=True)),
            "",
            "held by Node gpu-a (node-1), which was declared lost, so nothing can fetch them",
        ),
        (
            attrs.evolve(GOOD, holder=attrs.evolve(HOLDER, retired=True)),
            "",
            "held by Node gpu-a (node-1), whose credential was revoked",
        ),
        (attrs.evolve(GOOD, holder=None), "", "the Node gpu-a that holds them is no longer"),
        (
            attrs.evolve(GOOD, out_dir=f"{ROOT}/../etc"),
            ROOT,
            "reported the output directory '/mnt/tp-out/../etc', which is not an absolute, "
            "normalised path",
        ),
        (attrs.evolve(GOOD, out_dir="tp-out/run-a"), "", "is not an absolute, normalised path"),
    ],
)
def test_every_refusal_names_the_run_and_why(found: SourceRun | None, root: str, said: str) -> None:
    with pytest.raises(JobSpecError, match="JobSpec field 'init_from' = 'run-a'") as caught:
        resolve_source("run-a", found, "default", root)
    assert said in str(caught.value)


@given(
    root=st.sampled_from(["", ROOT, "/mnt/other", "/"]),
    holder=st.none()
    | st.builds(
        Holder,
        node_id=st.just("node-1"),
        name=st.sampled_from(["gpu-a", "node-1"]),
        outputs_address=st.sampled_from(["", "10.0.0.1:7463"]),
        lost=st.booleans(),
        retired=st.booleans(),
    ),
)
def test_the_holder_decides_only_off_the_shared_root(root: str, holder: Holder | None) -> None:
    found = attrs.evolve(GOOD, holder=holder)
    shared = root in (ROOT, "/")
    fetchable = (
        holder is not None and holder.outputs_address and not holder.lost and not holder.retired
    )
    if shared or fetchable:
        source = resolve_source("run-a", found, "default", root)
        assert source.node_id == ("" if shared else "node-1")
        assert (source.out_dir, source.manifest_sha256) == (GOOD.out_dir, SHA)
        return
    with pytest.raises(JobSpecError) as caught:
        resolve_source("run-a", found, "default", root)
    said = str(caught.value)
    assert "the run run-a's outputs" in said and GOOD.out_dir in said
    assert holder is None or f"Node {holder.name} (node-1)" in said


def test_a_malformed_reported_summary_is_stored_as_a_problem() -> None:
    assert stored_manifest(ManifestSummary(1, 2, SHA)) == ManifestSummary(1, 2, SHA)
    bad = stored_manifest(ManifestSummary(1, 2, "not-a-digest"))
    assert bad.sha256 == "" and "malformed output manifest" in bad.problem
    assert ManifestSummary.from_json(bad.to_json()) == bad
    assert ManifestSummary.from_json("") is None


def _spec_json(**extra: object) -> str:
    spec = {
        "api_version": "tuneplane/v1",
        "project": "p",
        "experiment": "e",
        "method_id": "custom/custom",
        "recipe_digest": "sha256:" + "0" * 64,
        "runtime_id": "host:python3",
        "entrypoint": ["bash", "train.sh"],
        "resources": {"profile": "h200:1", "series": "", "gpus": 1},
        **extra,
    }
    return json.dumps(spec)


def test_the_source_travels_in_the_jobspec_and_must_match_init_from() -> None:
    source = attrs.asdict(InitFromSource("run-a", 1, 0, GOOD.out_dir, SHA, 2, 1234))
    spec = loads(_spec_json(init_from="run-a", init_from_source=source))
    assert spec.init_from_source is not None and spec.init_from_source.out_dir == GOOD.out_dir
    assert '"init_from_source"' in canonical_json(spec)
    assert '"init_from_source"' not in canonical_json(loads(_spec_json()))
    with pytest.raises(JobSpecError, match="does not match init_from"):
        loads(_spec_json(init_from="run-b", init_from_source=source))
    with pytest.raises(JobSpecError, match="is not an absolute, normalised path"):
        loads(_spec_json(init_from="run-a", init_from_source={**source, "out_dir": "a/../b"}))


def test_shared_output_root_is_read_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.toml"
    path.write_text(DEFAULT_CONFIG + f'[fleet.default]\nshared_output_root = "{ROOT}/"\n')
    assert load_config(tmp_path).fleets["default"].shared_output_root == ROOT
    path.write_text(DEFAULT_CONFIG + '[fleet.default]\nshared_output_root = "tp-out"\n')
    with pytest.raises(ConfigError, match="shared_output_root = 'tp-out' is not an absolute"):
        load_config(tmp_path)
