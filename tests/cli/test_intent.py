"""Building the JobSpec intent: same intent -> same digest, any edit -> a new one; typed inputs."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from tuneplane.coordinator.catalogue import Catalogue, Parameter
from tuneplane.coordinator.cli.intent import (
    IntentError,
    SubmitRequest,
    build_jobspec,
    collect_source_files,
    parse_text,
)
from tuneplane.coordinator.cli.project import LOCK_FILE, Project, ProjectError, init_project
from tuneplane.coordinator.cli.scaffold import new_experiment
from tuneplane.proto.contract import jobspec

CATALOGUE = Catalogue.bundled()


@pytest.fixture
def project(tmp_path: Path) -> Project:
    project = init_project(tmp_path / "proj", "demo")
    new_experiment(project, "hello", "custom/custom", CATALOGUE)
    new_experiment(project, "ar", "pytorch/process-group", CATALOGUE)
    return project


def _digest(project: Project, request: SubmitRequest) -> str:
    return jobspec.digest(build_jobspec(project, request, CATALOGUE))


HELLO = SubmitRequest("hello", profile="h200:2")
AR = SubmitRequest("ar", profile="h200:4")


def test_the_jobspec_carries_the_lock_files_and_shape(project: Project) -> None:
    spec = build_jobspec(project, SubmitRequest("ar", profile="h200:4", members=2), CATALOGUE)
    recipe = CATALOGUE.recipes["pytorch/process-group"]
    assert spec.project == "demo" and spec.experiment == "ar"
    assert spec.method_id == recipe.method_id and spec.recipe_digest == recipe.digest
    assert spec.runtime_id == recipe.runtime_id
    assert spec.entrypoint == ("python3", "train.py")
    assert spec.resources == jobspec.Resources(
        profile="h200:4", series="", gpus=4, members=2, gpus_per_member=2
    )
    assert dict(spec.parameters) == {"script": "train.py", "steps": 100, "learning_rate": 0.001}
    assert sorted(spec.source_files) == ["config.yaml", "recipe.lock.json", "train.py"]
    train = base64.b64decode(spec.source_files["train.py"])
    assert train == (project.experiment_dir("ar") / "train.py").read_bytes()
    # What tp builds, the coordinator's own parser accepts unchanged.
    assert jobspec.loads(jobspec.canonical_json(spec)) == spec


def test_same_intent_same_digest(project: Project) -> None:
    assert _digest(project, HELLO) == _digest(project, HELLO)
    assert _digest(project, AR) == _digest(project, AR)


@pytest.mark.parametrize(
    "edit",
    [
        "file",
        "new file",
        "nested file",
        "config param",
        "config env",
        "flag param",
        "flag env",
        "profile",
        "members",
        "init from",
        "grace",
    ],
)
def test_any_edit_changes_the_digest(project: Project, edit: str) -> None:
    folder = project.experiment_dir("ar")
    before = _digest(project, AR)
    request = AR
    if edit == "file":
        path = folder / "train.py"
        path.write_text(path.read_text() + "# tweak\n")
    elif edit == "new file":
        (folder / "notes.txt").write_text("x")
    elif edit == "nested file":
        (folder / "lib").mkdir()
        (folder / "lib" / "util.py").write_text("X = 1\n")
    elif edit == "config param":
        (folder / "config.yaml").write_text("parameters:\n  steps: 101\n")
    elif edit == "config env":
        (folder / "config.yaml").write_text("env:\n  SEED: '2'\n")
    elif edit == "flag param":
        request = SubmitRequest("ar", profile="h200:4", params=("learning_rate=0.01",))
    elif edit == "flag env":
        request = SubmitRequest("ar", profile="h200:4", env=("SEED=1",))
    elif edit == "profile":
        request = SubmitRequest("ar", profile="h200:8")
    elif edit == "members":
        request = SubmitRequest("ar", profile="h200:4", members=2)
    elif edit == "init from":
        request = SubmitRequest("ar", profile="h200:4", init_from="run-abc")
    elif edit == "grace":
        (folder / "config.yaml").write_text("grace_period_s: 31\n")
    assert _digest(project, request) != before


def test_local_records_vcs_and_caches_are_not_part_of_the_intent(project: Project) -> None:
    folder = project.experiment_dir("hello")
    before = _digest(project, HELLO)
    for skipped in (".tuneplane-data", ".git", "__pycache__", ".pytest_cache"):
        (folder / skipped).mkdir()
        (folder / skipped / "blob").write_bytes(b"\0" * 100)
    # A symbolic link is refused, not skipped: tests/security/test_bad_input.py.
    assert _digest(project, HELLO) == before
    assert sorted(collect_source_files(folder)) == ["config.yaml", "recipe.lock.json", "train.sh"]


def test_huge_experiment_is_refused_naming_the_biggest_file(project: Project) -> None:
    folder = project.experiment_dir("hello")
    (folder / "weights.bin").write_bytes(b"\0" * 4096)
    with pytest.raises(
        ProjectError, match=r"over the 2048 byte limit.*weights\.bin \(4096 bytes\)"
    ):
        collect_source_files(folder, limit=2048)


def test_config_then_flags_override_recipe_defaults(project: Project) -> None:
    (project.experiment_dir("ar") / "config.yaml").write_text(
        "parameters:\n  steps: 5\n  learning_rate: 1\nenv:\n  A: config\n  B: config\n"
    )
    request = SubmitRequest(
        "ar", profile="h200:1", params=("steps=9", "script=main.py"), env=("B=flag",)
    )
    spec = build_jobspec(project, request, CATALOGUE)
    assert dict(spec.parameters) == {"script": "main.py", "steps": 9, "learning_rate": 1.0}
    assert isinstance(spec.parameters["learning_rate"], float)
    assert spec.entrypoint == ("python3", "main.py")
    assert dict(spec.env) == {"A": "config", "B": "flag"}


@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        ("steps=ten", r"--param steps: parameter 'steps' must be an int, not 'ten'"),
        ("steps=1.5", r"must be an int, not '1.5'"),
        ("steps=0", r"'steps' = 0 is below its minimum 1"),
        ("learning_rate=fast", r"'learning_rate' must be a float, not 'fast'"),
        ("learning_rate=11", r"'learning_rate' = 11.0 is above its maximum 10"),
        ("learning_rate=nan", r"must be a finite number"),
        ("epochs=3", r"has no parameter 'epochs' \(it has: learning_rate, script, steps\)"),
        ("steps", r"is not NAME=VALUE"),
    ],
)
def test_bad_param_flags_name_the_parameter(project: Project, flag: str, expected: str) -> None:
    with pytest.raises(IntentError, match=expected):
        build_jobspec(project, SubmitRequest("ar", profile="h200:1", params=(flag,)), CATALOGUE)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ("parameters:\n  steps: '10'\n", r"parameter 'steps' must be an int, not '10' \(str\)"),
        ("parameters:\n  steps: true\n", r"parameter 'steps' must be an int, not True"),
        ("parameters:\n  learning_rate: 20\n", r"is above its maximum 10"),
        ("parameters:\n  epochs: 3\n", r"key 'parameters.epochs'.*has no parameter 'epochs'"),
    ],
)
def test_bad_config_parameters_name_file_and_parameter(
    project: Project, config: str, expected: str
) -> None:
    (project.experiment_dir("ar") / "config.yaml").write_text(config)
    with pytest.raises(ProjectError, match=expected) as info:
        build_jobspec(project, SubmitRequest("ar", profile="h200:1"), CATALOGUE)
    assert "experiments/ar/config.yaml" in str(info.value)


def test_bool_parameters_accept_true_false_words(project: Project) -> None:
    flag = Parameter(name="shuffle", type="bool")
    assert parse_text(flag, "true", "--param shuffle") is True
    assert parse_text(flag, "No", "--param shuffle") is False
    with pytest.raises(IntentError, match=r"must be a bool \(true or false\), not 'maybe'"):
        parse_text(flag, "maybe", "--param shuffle")


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        (SubmitRequest("hello", profile="H200"), r"--profile: 'H200' is not a Profile"),
        (SubmitRequest("hello", profile="h200:two"), r"write NAME or NAME:GPUS"),
        (SubmitRequest("hello", profile="h200:3", members=2), r"--members 2 does not divide"),
        (SubmitRequest("hello", profile="h200:64", members=33), r"1 to 32 members"),
        (SubmitRequest("hello"), r"No Profile given: pass --profile"),
        (SubmitRequest("hello", profile="h200", env=("TUNEPLANE_X=1",)), r"reserved"),
        (SubmitRequest("hello", profile="h200", env=("1X=1",)), r"not a valid environment"),
        (SubmitRequest("hello", profile="h200", init_from="../x"), r"not a run id"),
        (SubmitRequest("nope", profile="h200"), r"no experiment 'nope'.*ar, hello"),
    ],
)
def test_bad_flags_are_intent_errors(
    project: Project, request_: SubmitRequest, expected: str
) -> None:
    with pytest.raises(IntentError, match=expected):
        build_jobspec(project, request_, CATALOGUE)


def test_profile_from_config_and_default_gpu_count(project: Project) -> None:
    (project.experiment_dir("hello") / "config.yaml").write_text("profile: h200:2\n")
    spec = build_jobspec(project, SubmitRequest("hello"), CATALOGUE)
    assert (spec.resources.profile, spec.resources.gpus) == ("h200:2", 2)
    spec = build_jobspec(project, SubmitRequest("hello", profile="h100"), CATALOGUE)
    assert (spec.resources.profile, spec.resources.gpus, spec.resources.members) == (
        "h100",
        1,
        None,
    )
    spec = build_jobspec(project, SubmitRequest("hello", profile="h100", members=3), CATALOGUE)
    assert (spec.resources.gpus, spec.resources.gpus_per_member) == (3, 1)


def test_stale_lock_is_refused_before_building(project: Project) -> None:
    path = project.experiment_dir("hello") / LOCK_FILE
    raw = json.loads(path.read_text())
    raw["recipe_digest"] = "sha256:" + "1" * 64
    path.write_text(json.dumps(raw))
    with pytest.raises(ProjectError, match=r"stale.*Run `tp recipe upgrade hello`"):
        build_jobspec(project, HELLO, CATALOGUE)
