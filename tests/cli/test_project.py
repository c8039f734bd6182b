"""Project discovery, tuneplane.yaml / config.yaml validation, tp new and recipe upgrade on disk."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tuneplane.coordinator.catalogue import Catalogue
from tuneplane.coordinator.cli.project import (
    LOCK_FILE,
    Project,
    ProjectError,
    RecipeLock,
    StaleLockError,
    check_lock_current,
    find_project,
    init_project,
    read_config,
    read_lock,
    upgrade_lock,
)
from tuneplane.coordinator.cli.scaffold import new_experiment

CATALOGUE = Catalogue.bundled()


@pytest.fixture
def project(tmp_path: Path) -> Project:
    return init_project(tmp_path / "proj", "demo")


def test_found_from_a_nested_directory(project: Project) -> None:
    deep = project.root / "experiments" / "x" / "data"
    deep.mkdir(parents=True)
    found = find_project(deep)
    assert found.root == project.root.resolve()
    assert found.name == "demo"


def test_nearest_project_wins(project: Project) -> None:
    inner = init_project(project.root / "sub", "inner")
    assert find_project(inner.root / ".").name == "inner"
    assert find_project(project.root).name == "demo"


def test_no_project_names_tp_init(tmp_path: Path) -> None:
    with pytest.raises(ProjectError, match=r"`tp init`") as info:
        find_project(tmp_path)
    assert "tuneplane.yaml" in str(info.value)


def test_init_refuses_to_overwrite(project: Project) -> None:
    with pytest.raises(ProjectError, match="already exists"):
        init_project(project.root, "other")
    assert find_project(project.root).name == "demo"


def test_init_derives_a_valid_name(tmp_path: Path) -> None:
    folder = tmp_path / "My Work_2"
    folder.mkdir()
    assert init_project(folder).name == "my-work_2"


def test_init_refuses_an_invalid_name(tmp_path: Path) -> None:
    with pytest.raises(ProjectError, match="'Bad Name' is not valid"):
        init_project(tmp_path, "Bad Name")
    assert not (tmp_path / "tuneplane.yaml").exists()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("name: [unclosed\n", r"not valid YAML at line 2"),
        ("name: demo\nowner: me\n", r"unknown key 'owner'"),
        ("- a\n- b\n", r"must be a mapping"),
        ("name: Demo Project\n", r"key 'name' = 'Demo Project' is not valid"),
        ("other: 1\n", r"unknown key 'other'"),
        ("# only a comment\n", r"must set 'name'"),
    ],
)
def test_bad_tuneplane_yaml_names_file_and_problem(
    tmp_path: Path, text: str, expected: str
) -> None:
    (tmp_path / "tuneplane.yaml").write_text(text)
    with pytest.raises(ProjectError, match=expected) as info:
        find_project(tmp_path)
    assert str(tmp_path / "tuneplane.yaml") in str(info.value)


def test_new_writes_config_lock_and_executable_train_sh(project: Project) -> None:
    written = new_experiment(project, "hello", "custom/custom", CATALOGUE)
    folder = project.experiment_dir("hello")
    assert sorted(p.name for p in written) == ["config.yaml", "recipe.lock.json", "train.sh"]
    assert os.access(folder / "train.sh", os.X_OK)
    lock = read_lock(project, "hello")
    assert lock == RecipeLock.of(CATALOGUE.recipes["custom/custom"])
    assert check_lock_current(project, "hello", CATALOGUE) == lock
    assert read_config(project, "hello").grace_period_s == 30
    assert project.experiments() == ["hello"]


def test_new_process_group_writes_train_py_and_parameter_defaults(project: Project) -> None:
    new_experiment(project, "ar", "pytorch/process-group", CATALOGUE)
    folder = project.experiment_dir("ar")
    assert (folder / "train.py").is_file()
    config = read_config(project, "ar")
    assert dict(config.parameters) == {"script": "train.py", "steps": 100, "learning_rate": 0.001}


def test_new_refuses_unknown_method_and_existing_experiment(project: Project) -> None:
    with pytest.raises(ProjectError, match="no recipe for method 'trl/kto'"):
        new_experiment(project, "x", "trl/kto", CATALOGUE)
    assert not project.experiment_dir("x").exists()
    new_experiment(project, "x", "custom/custom", CATALOGUE)
    (project.experiment_dir("x") / "train.sh").write_text("echo mine\n")
    with pytest.raises(ProjectError, match="already exists"):
        new_experiment(project, "x", "custom/custom", CATALOGUE)
    assert (project.experiment_dir("x") / "train.sh").read_text() == "echo mine\n"


def test_new_refuses_a_name_the_jobspec_would_refuse(project: Project) -> None:
    with pytest.raises(ProjectError, match="experiment name 'My_Exp' is not valid"):
        new_experiment(project, "My_Exp", "custom/custom", CATALOGUE)


def _stale(project: Project, experiment: str) -> dict[str, object]:
    path = project.experiment_dir(experiment) / LOCK_FILE
    raw = json.loads(path.read_text())
    raw["recipe_digest"] = "sha256:" + "0" * 64
    raw["recipe_version"] = "0.9.0"
    path.write_text(json.dumps(raw))
    return dict(raw)


def test_stale_lock_is_refused_and_upgrade_fixes_it(project: Project) -> None:
    new_experiment(project, "hello", "custom/custom", CATALOGUE)
    _stale(project, "hello")
    with pytest.raises(StaleLockError, match=r"Run `tp recipe upgrade hello`") as info:
        check_lock_current(project, "hello", CATALOGUE)
    assert "experiments/hello/recipe.lock.json is stale" in str(info.value)
    old, new = upgrade_lock(project, "hello", CATALOGUE)
    assert old is not None
    changes = old.differences(new)
    assert any(line.startswith("recipe_digest: sha256:000") for line in changes)
    assert "recipe_version: 0.9.0 -> 1.1.0" in changes
    assert check_lock_current(project, "hello", CATALOGUE) == new
    again_old, again_new = upgrade_lock(project, "hello", CATALOGUE)
    assert again_old == again_new


def test_lock_for_a_method_the_catalogue_lacks(project: Project) -> None:
    new_experiment(project, "hello", "custom/custom", CATALOGUE)
    path = project.experiment_dir("hello") / LOCK_FILE
    path.write_text(path.read_text().replace("custom/custom", "trl/kto"))
    with pytest.raises(StaleLockError, match="pins method trl/kto"):
        check_lock_current(project, "hello", CATALOGUE)
    with pytest.raises(ProjectError, match="no recipe for method 'trl/kto'"):
        upgrade_lock(project, "hello", CATALOGUE)
    upgrade_lock(project, "hello", CATALOGUE, method_id="custom/custom")
    assert read_lock(project, "hello").method_id == "custom/custom"


def test_missing_or_broken_lock_is_rewritten_only_with_a_method(project: Project) -> None:
    new_experiment(project, "hello", "custom/custom", CATALOGUE)
    path = project.experiment_dir("hello") / LOCK_FILE
    path.write_text("{not json")
    with pytest.raises(ProjectError, match="not readable JSON"):
        upgrade_lock(project, "hello", CATALOGUE)
    path.unlink()
    with pytest.raises(ProjectError, match=r"does not exist.*--method"):
        read_lock(project, "hello")
    old, new = upgrade_lock(project, "hello", CATALOGUE, method_id="custom/custom")
    assert old is None and new == read_lock(project, "hello")


def test_upgrade_of_an_unknown_experiment(project: Project) -> None:
    with pytest.raises(ProjectError, match=r"There is no experiment 'nope'.*`tp new nope"):
        upgrade_lock(project, "nope", CATALOGUE)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("parameter:\n  steps: 1\n", r"unknown key 'parameter'"),
        ("env:\n  THREADS: 4\n", r"key 'env.THREADS' is 4 \(int\).*quote it"),
        ("env:\n  TUNEPLANE_X: a\n", r"'env.TUNEPLANE_X' uses the reserved TUNEPLANE_ prefix"),
        ("grace_period_s: 7200\n", r"key 'grace_period_s' is 7200"),
        ("grace_period_s: '30'\n", r"key 'grace_period_s' is '30'"),
        ("profile: 8\n", r"key 'profile' must be a Profile name"),
        ("parameters: [1, 2]\n", r"key 'parameters' must map"),
        ("env: [1]\n", r"key 'env' must map"),
    ],
)
def test_bad_config_yaml_names_file_and_key(project: Project, text: str, expected: str) -> None:
    new_experiment(project, "hello", "custom/custom", CATALOGUE)
    (project.experiment_dir("hello") / "config.yaml").write_text(text)
    with pytest.raises(ProjectError, match=expected) as info:
        read_config(project, "hello")
    assert "experiments/hello/config.yaml" in str(info.value)


def test_config_yaml_values_are_read(project: Project) -> None:
    new_experiment(project, "ar", "pytorch/process-group", CATALOGUE)
    (project.experiment_dir("ar") / "config.yaml").write_text(
        "parameters:\n  steps: 7\nenv:\n  SEED: '1'\nprofile: h200:2\ngrace_period_s: 5\n"
    )
    config = read_config(project, "ar")
    assert dict(config.parameters) == {"steps": 7}
    assert dict(config.env) == {"SEED": "1"}
    assert config.profile == "h200:2"
    assert config.grace_period_s == 5
