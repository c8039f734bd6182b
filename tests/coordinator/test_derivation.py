"""The Derivation's rules, pure: which run may seed a new one, and the sentence when it may not;
the resolved JobSpec carries the source (its digest covers it) and an intent may not set it."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from tuneplane.coordinator.config import DEFAULT_CONFIG, ConfigError, load_config
from tuneplane.coordinator.derivation import (
    InitFromSource,
    ManifestSummary,
    SourceRun,
    resolve_source,
    stored_manifest,
)
from tuneplane.coordinator.jobspec import JobSpecError, canonical_json, loads

pytestmark = pytest.mark.timeout(30)

SHA = "ab" * 32
ROOT = "/mnt/tp-out"
GOOD = SourceRun(
    "run-a", "succeeded", True, "alice", 1, f"{ROOT}/run-a/attempt-1/member-0", "gpu-a",
    ManifestSummary(2, 1234, SHA),
)  # fmt: skip


def test_a_succeeded_readable_run_under_the_shared_root_is_the_source() -> None:
    source = resolve_source("run-a", GOOD, "default", ROOT)
    assert source == InitFromSource("run-a", 1, 0, GOOD.out_dir, SHA, 2, 1234)


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
        (GOOD, "", "declares no shared_output_root, and fetching outputs from the Node"),
        (GOOD, "/mnt/other", "are not under the Fleet default's shared output root /mnt/other"),
        (attrs.evolve(GOOD, out_dir=f"{ROOT}/../etc"), ROOT, "are not under the Fleet"),
    ],
)
def test_every_refusal_names_the_run_and_why(found: SourceRun | None, root: str, said: str) -> None:
    with pytest.raises(JobSpecError, match="JobSpec field 'init_from' = 'run-a'") as caught:
        resolve_source("run-a", found, "default", root)
    assert said in str(caught.value)


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
