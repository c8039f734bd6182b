"""A researcher's project on disk: ``tuneplane.yaml``, ``experiments/<name>/`` and their files.

Rules: the project is found by walking up from a directory, as git finds ``.git``; every file is
validated on reading and every error names the file, the key, what is wrong and how to fix it
(:class:`ProjectError`); every file ``tp`` writes is written atomically (tmp, fsync, rename, fsync
the directory), so an interrupted ``tp`` never leaves half a file behind.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import yaml

from tuneplane.agent.atomic_file import write_atomic
from tuneplane.proto.contract.input_checks import SET_BY_TUNEPLANE_FIX

from ..catalogue import Catalogue, Recipe

PROJECT_FILE = "tuneplane.yaml"
EXPERIMENTS_DIR = "experiments"
DATA_DIR = ".tuneplane-data"
CONFIG_FILE = "config.yaml"
LOCK_FILE = "recipe.lock.json"
DEFAULT_GRACE_PERIOD_S = 30
# The same rule the JobSpec applies to project and experiment names.
NAME_RULE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
NAME_RULE_TEXT = "1-63 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit"


class ProjectError(Exception):
    """A project file is missing or wrong. ``str()`` is a sentence naming the file and the fix."""


class StaleLockError(ProjectError):
    """``recipe.lock.json`` pins a recipe the Catalogue no longer publishes."""


def _load_yaml(path: Path, shown: str) -> Mapping[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProjectError(f"{shown} does not exist.") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ProjectError(f"{shown} cannot be read ({exc}); check the file.") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ProjectError(f"{shown} is not valid YAML{where}: {problem}. Fix the file.") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ProjectError(
            f"{shown} must be a mapping of keys to values, not {type(data).__name__}."
        )
    return data


def _refuse_unknown_keys(data: Mapping[str, Any], allowed: tuple[str, ...], shown: str) -> None:
    for key in data:
        if key not in allowed:
            raise ProjectError(
                f"{shown} has an unknown key '{key}'; the keys it may hold are "
                f"{', '.join(allowed)}. Remove or rename it."
            )


@attrs.frozen
class Project:
    """A directory holding ``tuneplane.yaml``; ``name`` groups every Job submitted from it."""

    root: Path
    name: str
    # TunePlane users besides the submitter who may read this project's Jobs (state, logs,
    # metrics); carried in every JobSpec submitted from here. Never lets them change a Job.
    share_with: tuple[str, ...] = ()

    @property
    def data_dir(self) -> Path:
        """Where ``tp`` keeps local records (previews, receipts); never sent with a Job."""
        return self.root / DATA_DIR

    def experiment_dir(self, experiment: str) -> Path:
        return self.root / EXPERIMENTS_DIR / experiment

    def experiments(self) -> list[str]:
        folder = self.root / EXPERIMENTS_DIR
        if not folder.is_dir():
            return []
        return sorted(p.name for p in folder.iterdir() if (p / LOCK_FILE).exists())

    def shown(self, path: Path) -> str:
        """``path`` relative to the project root, as people see it in messages."""
        try:
            return str(path.relative_to(self.root))
        except ValueError:
            return str(path)


def check_name(kind: str, name: str) -> None:
    """Refuse a project or experiment name the JobSpec would refuse, before anything is written."""
    if not NAME_RULE.match(name):
        raise ProjectError(f"The {kind} name '{name}' is not valid: use {NAME_RULE_TEXT}.")


def load_project(root: Path) -> Project:
    """Read ``root/tuneplane.yaml``."""
    path = root / PROJECT_FILE
    shown = str(path)
    data = _load_yaml(path, shown)
    _refuse_unknown_keys(data, ("name", "share_with"), shown)
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ProjectError(f"{shown} must set 'name' to the project's name, e.g. 'name: demo'.")
    if not NAME_RULE.match(name):
        raise ProjectError(f"{shown} key 'name' = '{name}' is not valid: use {NAME_RULE_TEXT}.")
    return Project(root=root, name=name, share_with=_share_with(data.get("share_with"), shown))


def _share_with(value: object, shown: str) -> tuple[str, ...]:
    """``share_with``: a list of TunePlane user names (absent: the project shares nothing)."""
    if value is None:
        return ()
    example = "e.g. 'share_with: [alice, bob]'"
    if not isinstance(value, list):
        raise ProjectError(
            f"{shown} key 'share_with' must be a list of TunePlane user names, {example}."
        )
    names: list[str] = []
    for item in value:
        if not isinstance(item, str) or not NAME_RULE.match(item):
            raise ProjectError(
                f"{shown} key 'share_with' holds {item!r}, which is not a user name: use "
                f"{NAME_RULE_TEXT}, {example}."
            )
        if item not in names:
            names.append(item)
    return tuple(names)


def find_project(start: Path) -> Project:
    """The project holding ``start``: the nearest directory at or above it with tuneplane.yaml."""
    here = start.resolve()
    for folder in (here, *here.parents):
        if (folder / PROJECT_FILE).is_file():
            return load_project(folder)
    raise ProjectError(
        f"No TunePlane project here: neither {here} nor any directory above it holds "
        f"{PROJECT_FILE}. Run `tp init` in your project's top directory first."
    )


def default_project_name(folder: Path) -> str:
    """A valid project name derived from a directory name ("My Work" -> "my-work")."""
    name = re.sub(r"[^a-z0-9_.-]+", "-", folder.resolve().name.lower()).strip("-._")
    return name[:63]


def init_project(folder: Path, name: str | None = None) -> Project:
    """Write ``folder/tuneplane.yaml``; refuses to overwrite an existing one."""
    folder = folder.resolve()
    path = folder / PROJECT_FILE
    if path.exists():
        raise ProjectError(f"{path} already exists; this directory is already a project.")
    chosen = name if name is not None else default_project_name(folder)
    if not chosen:
        raise ProjectError(
            f"Cannot derive a project name from {folder.name!r}; give one with --name."
        )
    check_name("project", chosen)
    text = (
        "# A TunePlane project: `tp` groups every Job submitted from here under `name`.\n"
        "# Experiments live in experiments/<name>/: `tp new <name> --method <method id>`.\n"
        f"name: {chosen}\n"
    )
    write_atomic(path, text.encode("utf-8"), parents=True)
    return Project(root=folder, name=chosen)


# -- recipe.lock.json ------------------------------------------------------------------------


@attrs.frozen
class RecipeLock:
    """What an experiment pins: the recipe (by digest), its framework version and runtime."""

    method_id: str
    recipe_version: str
    recipe_digest: str
    framework_name: str
    framework_version: str
    runtime_id: str

    @classmethod
    def of(cls, recipe: Recipe) -> RecipeLock:
        return cls(
            method_id=recipe.method_id,
            recipe_version=recipe.version,
            recipe_digest=recipe.digest,
            framework_name=recipe.framework_name,
            framework_version=recipe.framework_version,
            runtime_id=recipe.runtime_id,
        )

    def to_json(self) -> str:
        data = {
            "method_id": self.method_id,
            "recipe_version": self.recipe_version,
            "recipe_digest": self.recipe_digest,
            "framework": {"name": self.framework_name, "version": self.framework_version},
            "runtime_id": self.runtime_id,
        }
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    def differences(self, other: RecipeLock) -> list[str]:
        """Human lines naming each pinned value that differs from ``other`` (old -> new)."""
        lines = []
        for field in attrs.fields(RecipeLock):
            old, new = getattr(self, field.name), getattr(other, field.name)
            if old != new:
                lines.append(f"{field.name}: {old} -> {new}")
        return lines


def read_lock(project: Project, experiment: str) -> RecipeLock:
    path = project.experiment_dir(experiment) / LOCK_FILE
    shown = project.shown(path)
    fix = f"Rewrite it with `tp recipe upgrade {experiment} --method <framework>/<method>`."
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ProjectError(f"{shown} does not exist. {fix}") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ProjectError(f"{shown} is not readable JSON ({exc}). {fix}") from None
    if not isinstance(raw, dict):
        raise ProjectError(f"{shown} must hold a JSON object. {fix}")
    framework = raw.get("framework")
    if not isinstance(framework, dict):
        raise ProjectError(
            f"{shown} key 'framework' must be an object with name and version. {fix}"
        )
    values: dict[str, object] = {
        "method_id": raw.get("method_id"),
        "recipe_version": raw.get("recipe_version"),
        "recipe_digest": raw.get("recipe_digest"),
        "framework_name": framework.get("name"),
        "framework_version": framework.get("version"),
        "runtime_id": raw.get("runtime_id"),
    }
    for key, value in values.items():
        if not isinstance(value, str) or not value:
            shown_key = key.replace("framework_", "framework.")
            raise ProjectError(f"{shown} key '{shown_key}' is missing or not a string. {fix}")
    return RecipeLock(**{k: str(v) for k, v in values.items()})


def check_lock_current(project: Project, experiment: str, catalogue: Catalogue) -> RecipeLock:
    """The experiment's lock, if the Catalogue still publishes the recipe it pins."""
    lock = read_lock(project, experiment)
    shown = project.shown(project.experiment_dir(experiment) / LOCK_FILE)
    recipe = catalogue.get(lock.method_id)
    if recipe is None:
        raise StaleLockError(
            f"{shown} pins method {lock.method_id}, which the Catalogue does not publish "
            f"(it has {', '.join(sorted(catalogue.recipes))}). Run `tp recipe upgrade "
            f"{experiment} --method <framework>/<method>` to move to one it has."
        )
    if recipe.digest != lock.recipe_digest:
        raise StaleLockError(
            f"{shown} is stale: it pins {lock.method_id} {lock.recipe_version} "
            f"({lock.recipe_digest}) but the Catalogue now publishes {recipe.version} "
            f"({recipe.digest}). Run `tp recipe upgrade {experiment}` to move to it."
        )
    return lock


def upgrade_lock(
    project: Project, experiment: str, catalogue: Catalogue, method_id: str | None = None
) -> tuple[RecipeLock | None, RecipeLock]:
    """Rewrite the lock to the Catalogue's current recipe; returns (old lock or None, new lock).

    ``method_id`` moves the experiment to another method, or writes a lock that is missing or
    unreadable; without it the lock keeps its method.
    """
    folder = project.experiment_dir(experiment)
    if not folder.is_dir():
        raise ProjectError(
            f"There is no experiment '{experiment}' ({project.shown(folder)} does not exist); "
            f"create it with `tp new {experiment} --method <framework>/<method>`."
        )
    old: RecipeLock | None
    try:
        old = read_lock(project, experiment)
    except ProjectError:
        if method_id is None:
            raise
        old = None
    wanted = method_id if method_id is not None else old.method_id if old else ""
    recipe = _recipe_or_error(catalogue, wanted)
    new = RecipeLock.of(recipe)
    if old != new:
        write_atomic(folder / LOCK_FILE, new.to_json().encode("utf-8"), parents=True)
    return old, new


def _recipe_or_error(catalogue: Catalogue, method_id: str) -> Recipe:
    recipe = catalogue.get(method_id)
    if recipe is None:
        raise ProjectError(
            f"The Catalogue has no recipe for method '{method_id}'; it publishes "
            f"{', '.join(sorted(catalogue.recipes))} (see `tp recipe ls`)."
        )
    return recipe


# -- config.yaml -----------------------------------------------------------------------------

CONFIG_KEYS = ("parameters", "env", "profile", "grace_period_s")


@attrs.frozen
class ExperimentConfig:
    """``experiments/<name>/config.yaml``: defaults that ``tp submit`` flags override.

    ``parameters`` are raw YAML values; they are typed against the recipe when a JobSpec is built.
    """

    parameters: Mapping[str, Any] = attrs.field(factory=dict)
    env: Mapping[str, str] = attrs.field(factory=dict)
    profile: str | None = None
    grace_period_s: int = DEFAULT_GRACE_PERIOD_S


def read_config(project: Project, experiment: str) -> ExperimentConfig:
    path = project.experiment_dir(experiment) / CONFIG_FILE
    shown = project.shown(path)
    if not path.exists():
        return ExperimentConfig()
    data = _load_yaml(path, shown)
    _refuse_unknown_keys(data, CONFIG_KEYS, shown)
    params = data.get("parameters") or {}
    if not isinstance(params, Mapping) or not all(isinstance(k, str) for k in params):
        raise ProjectError(f"{shown} key 'parameters' must map parameter names to values.")
    env = data.get("env") or {}
    if not isinstance(env, Mapping):
        raise ProjectError(f"{shown} key 'env' must map variable names to string values.")
    for key, value in env.items():
        if not isinstance(key, str):
            raise ProjectError(f"{shown} key 'env' has a non-string name {key!r}; quote it.")
        if key.startswith("TUNEPLANE_"):
            raise ProjectError(
                f"{shown} key 'env.{key}' uses the reserved TUNEPLANE_ prefix. "
                f"{SET_BY_TUNEPLANE_FIX}."
            )
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ProjectError(
                f"{shown} key 'env.{key}' is not a usable variable name: use letters, digits "
                "and '_', not starting with a digit."
            )
        if not isinstance(value, str):
            raise ProjectError(
                f"{shown} key 'env.{key}' is {value!r} ({type(value).__name__}); environment "
                f"values are strings, so quote it: {key}: '{value}'."
            )
    profile = data.get("profile")
    if profile is not None and (not isinstance(profile, str) or not profile):
        raise ProjectError(
            f"{shown} key 'profile' must be a Profile name such as h200 or h200:8, not {profile!r}."
        )
    grace = data.get("grace_period_s", DEFAULT_GRACE_PERIOD_S)
    if type(grace) is not int or not 0 <= grace <= 3600:
        raise ProjectError(
            f"{shown} key 'grace_period_s' is {grace!r}; it must be a whole number of seconds "
            "from 0 to 3600."
        )
    return ExperimentConfig(
        parameters=dict(params), env=dict(env), profile=profile, grace_period_s=grace
    )
