"""Build the JobSpec intent ``tp submit`` sends: the experiment's files, parameters, env, shape.

Rules: the same experiment and flags always build the same JobSpec (files in sorted order, no
clocks, no host names), so the digest changes exactly when the intent does. A wrong flag value is
an :class:`IntentError` (the command line must change); a wrong project file is a
:class:`~tuneplane.coordinator.cli.project.ProjectError`.
"""

from __future__ import annotations

import base64
import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from tuneplane.proto.contract import jobspec
from tuneplane.proto.contract.input_checks import InputRefused, check_env, check_file_name

from ..catalogue import Catalogue, Parameter, Recipe
from .project import (
    CONFIG_FILE,
    DATA_DIR,
    Project,
    ProjectError,
    check_lock_current,
    read_config,
)

# Directories that are never part of an experiment's intent: local records, VCS, caches.
SKIPPED_DIRS = frozenset(
    {
        DATA_DIR,
        ".git",
        ".hg",
        ".svn",
        "__pycache__",
        ".mypy_cache",
        ".pytest_cache",
        ".ruff_cache",
        ".ipynb_checkpoints",
        ".venv",
        "node_modules",
    }
)
_PROFILE = re.compile(r"^(?P<name>[a-z0-9][a-z0-9_.-]{0,62})(?::(?P<gpus>\d{1,4}))?$")
_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


class IntentError(ValueError):
    """A ``tp submit`` flag value cannot be used; ``str()`` names the flag and the fix."""


@attrs.frozen
class SubmitRequest:
    """What the researcher asked for on the command line (None: take config.yaml's value)."""

    experiment: str
    profile: str | None = None
    members: int | None = None
    params: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    init_from: str | None = None
    # --image: the runtime image instead of the recipe's runtime (image:<registry>/<name>:<tag>
    # or @sha256:<hex>; the "image:" prefix may be left out). The coordinator pins a tag at
    # Preview.
    image: str | None = None


def _runtime(image: str) -> str:
    """``--image`` as a runtime id; its form is checked by the coordinator at Preview."""
    text = image.strip()
    if not text:
        raise IntentError(
            "--image is empty; name an image as <registry>/<name>:<tag> or "
            "<registry>/<name>@sha256:<64 hex digits>."
        )
    return text if text.startswith("image:") else f"image:{text}"


# -- parameters ------------------------------------------------------------------------------


def _check_range(param: Parameter, value: float, source: str) -> None:
    if param.min is not None and value < param.min:
        raise _error(
            source, f"parameter '{param.name}' = {value!r} is below its minimum {param.min:g}"
        )
    if param.max is not None and value > param.max:
        raise _error(
            source, f"parameter '{param.name}' = {value!r} is above its maximum {param.max:g}"
        )


def _error(source: str, text: str) -> Exception:
    """Errors from flags are IntentError, errors from config.yaml are ProjectError."""
    if source.startswith("--"):
        return IntentError(f"{source}: {text}.")
    return ProjectError(f"{source}: {text}.")


def _article(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


def type_value(param: Parameter, value: object, source: str) -> Any:
    """Check a YAML value against the recipe's type; ints are accepted for float parameters."""
    kinds = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,)}
    allowed = kinds.get(param.type)
    if allowed is None:
        raise _error(source, f"parameter '{param.name}' has unknown recipe type {param.type!r}")
    ok = isinstance(value, allowed) and (param.type == "bool" or not isinstance(value, bool))
    if not ok:
        raise _error(
            source,
            f"parameter '{param.name}' must be {_article(param.type)}, not {value!r} "
            f"({type(value).__name__})",
        )
    if param.type == "float":
        value = float(value)  # type: ignore[arg-type]
        if not math.isfinite(value):
            raise _error(source, f"parameter '{param.name}' must be a finite number")
    if param.type in ("int", "float"):
        _check_range(param, value, source)  # type: ignore[arg-type]
    return value


def parse_text(param: Parameter, text: str, source: str) -> Any:
    """Type a ``--param name=text`` value by the recipe's parameter type."""
    value: Any
    if param.type == "str":
        value = text
    elif param.type == "int":
        if not re.fullmatch(r"[+-]?\d+", text.strip()):
            raise _error(source, f"parameter '{param.name}' must be an int, not {text!r}")
        value = int(text)
    elif param.type == "float":
        try:
            value = float(text)
        except ValueError:
            raise _error(
                source, f"parameter '{param.name}' must be a float, not {text!r}"
            ) from None
    elif param.type == "bool":
        lowered = text.strip().lower()
        if lowered not in _TRUE | _FALSE:
            raise _error(
                source, f"parameter '{param.name}' must be a bool (true or false), not {text!r}"
            )
        value = lowered in _TRUE
    else:
        raise _error(source, f"parameter '{param.name}' has unknown recipe type {param.type!r}")
    return type_value(param, value, source)


def _known(recipe: Recipe) -> str:
    return ", ".join(sorted(recipe.parameters)) or "none"


def resolve_parameters(
    recipe: Recipe, from_config: Mapping[str, Any], flags: Iterable[str], config_shown: str
) -> dict[str, Any]:
    """Recipe defaults, then config.yaml, then ``--param`` flags; every value typed and checked."""
    values: dict[str, Any] = {
        name: p.default for name, p in recipe.parameters.items() if p.default is not None
    }
    for name, raw in from_config.items():
        param = recipe.parameters.get(name)
        if param is None:
            raise ProjectError(
                f"{config_shown} key 'parameters.{name}': recipe {recipe.method_id} has no "
                f"parameter '{name}' (it has: {_known(recipe)})."
            )
        values[name] = type_value(param, raw, f"{config_shown} key 'parameters.{name}'")
    for flag in flags:
        name, sep, text = flag.partition("=")
        if not sep or not name:
            raise IntentError(f"--param {flag!r} is not NAME=VALUE; write e.g. --param steps=10.")
        param = recipe.parameters.get(name)
        if param is None:
            raise IntentError(
                f"--param {name}: recipe {recipe.method_id} has no parameter '{name}' "
                f"(it has: {_known(recipe)})."
            )
        values[name] = parse_text(param, text, f"--param {name}")
    return values


def resolve_entrypoint(recipe: Recipe, parameters: Mapping[str, Any]) -> tuple[str, ...]:
    """The recipe's entrypoint with ``{parameter}`` placeholders filled in."""
    out = []
    for part in recipe.entrypoint:
        try:
            out.append(part.format_map({k: str(v) for k, v in parameters.items()}))
        except (KeyError, IndexError, ValueError) as exc:
            raise ProjectError(
                f"Recipe {recipe.method_id} entrypoint part {part!r} names {exc}, which has no "
                "value; set it under 'parameters' in config.yaml or with --param."
            ) from None
    return tuple(out)


# -- env, profile ----------------------------------------------------------------------------


def resolve_env(from_config: Mapping[str, str], flags: Iterable[str]) -> dict[str, str]:
    env = dict(from_config)
    for flag in flags:
        name, sep, value = flag.partition("=")
        if not sep or not name:
            raise IntentError(f"--env {flag!r} is not NAME=VALUE; write e.g. --env SEED=1.")
        try:
            check_env(name, value, "--env")
        except InputRefused as exc:
            raise IntentError(f"--env {name[:80]}: {exc.why}. {exc.fix}") from None
        env[name] = value
    return env


def parse_profile(text: str, source: str) -> tuple[str, int | None]:
    """``h200`` -> ("h200", None); ``h200:8`` -> ("h200", 8): GPUs for the whole Job."""
    match = _PROFILE.match(text)
    if match is None:
        raise _error(
            source,
            f"{text!r} is not a Profile; write NAME or NAME:GPUS, e.g. h200 or h200:8",
        )
    gpus = match.group("gpus")
    return match.group("name"), None if gpus is None else int(gpus)


def resolve_resources(profile_text: str, source: str, members: int | None) -> jobspec.Resources:
    """The Resource Pool: GPUS is the Job's total; ``--members`` splits it evenly across Nodes.

    ``resources.profile`` keeps the text as written (``h200:8``); the coordinator checks that its
    count agrees with ``resources.gpus``. Without GPUS the Job asks for one GPU per member (one
    member when --members is not given).
    """
    _, gpus = parse_profile(profile_text, source)
    if members is not None and not 1 <= members <= jobspec.MAX_MEMBERS:
        raise IntentError(
            f"--members {members}: a Resource Pool on the Node backend has 1 to "
            f"{jobspec.MAX_MEMBERS} members (one per Node)."
        )
    if gpus is None:
        gpus = members or 1
    per_member = None
    if members is not None:
        if gpus % members:
            raise IntentError(
                f"--members {members} does not divide the {gpus} GPUs of {profile_text!r}; "
                "every member gets the same number of GPUs, so pick a GPU count that is a "
                "multiple of --members."
            )
        per_member = gpus // members
    return jobspec.Resources(
        profile=profile_text, series="", gpus=gpus, members=members, gpus_per_member=per_member
    )


# -- experiment files ------------------------------------------------------------------------


def collect_source_files(folder: Path, limit: int = jobspec.MAX_SOURCE_BYTES) -> dict[str, str]:
    """Every regular file under ``folder`` (relative path -> base64), skipping VCS and caches.

    Only what is inside the experiment is ever read: a symbolic link is refused with its path
    (one that leads outside says where it leads), and every name passes the one file-name rule
    (:func:`~tuneplane.proto.contract.input_checks.check_file_name`) that Preview and Prepare apply
    too. Refuses an experiment larger than ``limit`` bytes, naming its biggest files.
    """
    root = folder.resolve()
    found: list[tuple[str, Path]] = []
    for path in _walk(root, root):
        found.append((path.relative_to(root).as_posix(), path))
    found.sort()
    sizes = [(path.lstat().st_size, rel) for rel, path in found]
    total = sum(size for size, _ in sizes)
    if total > limit:
        biggest = ", ".join(
            f"{rel} ({size} bytes)" for size, rel in sorted(sizes, reverse=True)[:3]
        )
        raise ProjectError(
            f"Experiment directory {folder} holds {total} bytes of files, over the {limit} byte "
            f"limit for what a Job carries (largest: {biggest}). Keep datasets and checkpoints "
            "out of the experiment directory."
        )
    return {rel: base64.b64encode(_read_regular(path)).decode("ascii") for rel, path in found}


def _walk(root: Path, folder: Path) -> Iterable[Path]:
    for entry in sorted(folder.iterdir()):
        if entry.name in SKIPPED_DIRS and entry.is_dir():
            continue
        rel = entry.relative_to(root).as_posix()
        try:
            check_file_name(rel, "Experiment file name")
        except InputRefused as exc:
            raise ProjectError(f"{exc} (file {entry})") from None
        if entry.is_symlink():
            _refuse_link(root, entry)
        if entry.is_dir():
            yield from _walk(root, entry)
        elif entry.is_file():
            yield entry


def _refuse_link(root: Path, link: Path) -> None:
    """A link is never followed: ``tp`` sends files, not links, and never what lies outside."""
    target = link.resolve()
    if target != root and root not in target.parents:
        raise ProjectError(
            f"{link} is a symbolic link that leads outside the experiment (to {target}); tp "
            "never uploads what is outside experiments/<name>/. Remove the link, or copy what "
            "the Job needs into the experiment."
        )
    raise ProjectError(
        f"{link} is a symbolic link (to {target}); tp sends only regular files and directories. "
        "Replace the link with a copy of its target, or remove it."
    )


def _read_regular(path: Path) -> bytes:
    """The file's bytes, refusing one that became a link since the walk (O_NOFOLLOW)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ProjectError(
            f"{path} cannot be read ({exc.strerror}); it changed while tp was reading the "
            "experiment (a link is never followed). Run the command again."
        ) from None
    with os.fdopen(fd, "rb") as f:
        return f.read()


# -- the whole intent ------------------------------------------------------------------------


def build_jobspec(
    project: Project, request: SubmitRequest, catalogue: Catalogue
) -> jobspec.JobSpec:
    """The JobSpec for ``request``; checks the lock against ``catalogue`` before anything else."""
    folder = project.experiment_dir(request.experiment)
    if not folder.is_dir():
        known = ", ".join(project.experiments()) or "none yet"
        raise IntentError(
            f"There is no experiment '{request.experiment}' in project {project.name} "
            f"({project.shown(folder)} does not exist; experiments: {known}). "
            f"Create it with `tp new {request.experiment} --method <framework>/<method>`."
        )
    lock = check_lock_current(project, request.experiment, catalogue)
    recipe = catalogue.recipes[lock.method_id]
    config = read_config(project, request.experiment)
    config_shown = project.shown(folder / CONFIG_FILE)
    parameters = resolve_parameters(recipe, config.parameters, request.params, config_shown)
    if request.profile is not None:
        resources = resolve_resources(request.profile, "--profile", request.members)
    elif config.profile is not None:
        resources = resolve_resources(
            config.profile, f"{config_shown} key 'profile'", request.members
        )
    else:
        raise IntentError(
            "No Profile given: pass --profile NAME[:GPUS] (e.g. --profile h200:8) or set "
            f"'profile' in {config_shown}."
        )
    init_from = request.init_from
    if init_from is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}", init_from):
        raise IntentError(f"--init-from {init_from!r} is not a run id; copy one from `tp job ls`.")
    spec = jobspec.JobSpec(
        api_version=jobspec.API_VERSION,
        project=project.name,
        experiment=request.experiment,
        method_id=lock.method_id,
        recipe_digest=lock.recipe_digest,
        runtime_id=_runtime(request.image) if request.image is not None else lock.runtime_id,
        entrypoint=resolve_entrypoint(recipe, parameters),
        resources=resources,
        parameters=parameters,
        env=resolve_env(config.env, request.env),
        grace_period_s=config.grace_period_s,
        init_from=init_from,
        source_files=collect_source_files(folder),
        share_with=project.share_with,
    )
    try:
        jobspec.validate(spec)
    except jobspec.JobSpecError as exc:
        raise IntentError(str(exc)) from None
    return spec
