"""Admission: turn a researcher's JobSpec intent into the resolved JobSpec the coordinator runs.

Rules:
- Pure: takes the JobSpec, ``coordinator.toml`` and the Catalogue, returns a resolved JobSpec and
  the summary a person confirms. Every refusal is a :class:`JobSpecError` naming the field.
- Resolution only fills what the intent left open (Series from the Profile, the Profile's default
  shape and env, recipe parameter defaults, the recipe's runtime); it never overrides a value the
  intent set, and a value that contradicts the Profile is refused rather than silently changed.
- What every rank runs is decided here, once: the resolved JobSpec's ``command`` (the entrypoint,
  then the recipe's parameter flags) and ``parameter_env`` (``TUNEPLANE_PARAM_*``), from
  :func:`.parameters.workload_command`. Preview shows them and the Node runs them as they are; an
  intent that sets them is refused. The entrypoint file the recipe names must be in the experiment.
- Site policy is checked on the resolved JobSpec (its runtime and its whole env, the Profile's
  included): loader variables only on a runtime coordinator.toml allows them for, and an
  ``image:`` runtime only from a registry the Profile's Fleet lists (:mod:`.image_pin`; Preview
  then pins it to a digest, which needs the network and so is not done here).
- :func:`admit` is the whole of it from JSON text to the canonical resolved JSON and its digest,
  with only text, bytes and small values in and out, so Preview can run it in a worker process for a
  JobSpec of megabytes.
"""

from __future__ import annotations

import difflib
import math
import posixpath
from typing import Any

import attrs

from tuneplane.proto.contract.jobspec import (
    JobSpec,
    JobSpecError,
    canonical_json,
    digest_of,
    loads,
    validate,
)

from .catalogue import Catalogue, Parameter, Recipe
from .config import CoordinatorConfig, Profile
from .image_pin import image_runtime, registry_for
from .jobspec import check_loader_policy
from .parameters import ParameterError, workload_command
from .values.jobs import PreviewSummary

BACKEND = "node"


@attrs.frozen
class Resolved:
    spec: JobSpec
    summary: PreviewSummary


@attrs.frozen
class Admitted:
    """A resolved JobSpec as Preview stores it: canonical JSON (UTF-8), its digest, the summary,
    and what placement needs to know whether it can ever fit."""

    resolved_json: bytes
    digest: str
    summary: PreviewSummary
    profile: str
    gpus: int
    members: int | None
    gpus_per_member: int | None
    # The run a Derivation names (``--init-from``); Preview resolves its source (derivation.py).
    init_from: str | None = None
    # The resolved runtime; an ``image:`` one is pinned to a digest by Preview (image_pin.py).
    runtime_id: str = ""


def admit(text: str, config: CoordinatorConfig, catalogue: Catalogue) -> Admitted:
    """Read, resolve and check JobSpec JSON. Raises :class:`JobSpecError`."""
    resolved = resolve(loads(text), config, catalogue)
    canonical = canonical_json(resolved.spec).encode("utf-8")
    res = resolved.spec.resources
    return Admitted(
        resolved_json=canonical,
        digest=digest_of(canonical),
        summary=resolved.summary,
        profile=res.profile,
        gpus=res.gpus,
        members=res.members,
        gpus_per_member=res.gpus_per_member,
        init_from=resolved.spec.init_from,
        runtime_id=resolved.spec.runtime_id,
    )


def _profile(spec: JobSpec, config: CoordinatorConfig) -> tuple[Profile, int | None]:
    """The Profile named by ``resources.profile`` (``name`` or ``name:<gpus>``)."""
    raw = spec.resources.profile
    name, sep, count = raw.partition(":")
    profile = config.profiles.get(name)
    if profile is None:
        known = ", ".join(sorted(config.profiles)) or "(none configured)"
        raise JobSpecError(
            "resources.profile",
            raw,
            "is not a Profile this coordinator knows",
            f"Use one of: {known}.",
        )
    shape_gpus: int | None = None
    if sep:
        if not count.isdigit():
            raise JobSpecError(
                "resources.profile",
                raw,
                "has a GPU count after ':' that is not a whole number",
                f"Write it as {name}:<gpus>, e.g. {name}:8.",
            )
        shape_gpus = int(count)
    return profile, shape_gpus


def _check_parameter(param: Parameter, value: object) -> None:
    field = f"parameters.{param.name}"
    kinds: dict[str, tuple[type, ...]] = {
        "str": (str,),
        "int": (int,),
        "float": (int, float),
        "bool": (bool,),
    }
    allowed = kinds.get(param.type, (object,))
    ok = isinstance(value, allowed) and (param.type == "bool" or not isinstance(value, bool))
    if not ok:
        raise JobSpecError(
            field,
            value,
            f"must be a {param.type}, got {type(value).__name__}",
            f"Set {param.name} to a {param.type} in the experiment's config.yaml.",
        )
    if param.type in ("int", "float"):
        number = float(value)  # type: ignore[arg-type]
        if not math.isfinite(number):
            raise JobSpecError(field, value, "is not a finite number", "Use a finite number.")
        if param.min is not None and number < param.min:
            raise JobSpecError(
                field,
                value,
                f"is below the recipe's minimum {param.min:g}",
                f"Set {param.name} between {param.min:g} and {param.max:g}."
                if param.max is not None
                else f"Set {param.name} to at least {param.min:g}.",
            )
        if param.max is not None and number > param.max:
            raise JobSpecError(
                field,
                value,
                f"is above the recipe's maximum {param.max:g}",
                f"Set {param.name} to at most {param.max:g}.",
            )


def _parameters(spec: JobSpec, recipe: Recipe) -> dict[str, Any]:
    resolved: dict[str, Any] = {}
    for name, value in spec.parameters.items():
        param = recipe.parameters.get(name)
        if param is None:
            known = ", ".join(sorted(recipe.parameters)) or "none"
            raise JobSpecError(
                f"parameters.{name}",
                value,
                f"is not a parameter of the recipe {recipe.method_id}",
                f"Remove it; the recipe takes: {known}.",
            )
        _check_parameter(param, value)
        resolved[name] = value
    for name, param in recipe.parameters.items():
        if name not in resolved and param.default is not None:
            resolved[name] = param.default
    return dict(sorted(resolved.items()))


def _check_entrypoint_file(spec: JobSpec, recipe: Recipe, parameters: dict[str, Any]) -> None:
    """The file the recipe's entrypoint runs (``python3 {script}``) is one of the experiment's."""
    index = recipe.entrypoint_file
    if index is None or index >= len(spec.entrypoint):
        return
    name = spec.entrypoint[index]
    if posixpath.normpath(name) in spec.source_files:
        return
    template = recipe.entrypoint[index]
    param = template[1:-1] if template.startswith("{") and template.endswith("}") else ""
    field = f"parameters.{param}" if parameters.get(param) == name else f"entrypoint[{index}]"
    files = sorted(spec.source_files)
    close = difflib.get_close_matches(name, files, n=1, cutoff=0.6)
    if close:
        seen = f"Did you mean '{close[0]}'? "
    elif files:
        shown = ", ".join(files[:8]) + (", ..." if len(files) > 8 else "")
        seen = f"Its files are: {shown}. "
    else:
        seen = "The experiment has no files. "
    if field.startswith("parameters."):
        fix = "Fix the name in config.yaml or --param" if files else "Add the file"
    else:
        # The recipe names the file itself (custom/custom runs train.sh): the experiment must
        # hold a file of that name.
        fix = f"The recipe {recipe.method_id} runs '{name}': add it to the experiment"
        fix += " or rename yours" if files else ""
    raise JobSpecError(
        field,
        name,
        f"is not a file of experiment '{spec.experiment}', so nothing would run",
        f"{seen}{fix} and preview again.",
    )


def resolve(spec: JobSpec, config: CoordinatorConfig, catalogue: Catalogue) -> Resolved:
    """Resolve and check a JobSpec. Raises :class:`JobSpecError` on the first problem."""
    validate(spec)
    sent: tuple[tuple[str, object], ...] = (
        ("command", list(spec.command)),
        ("parameter_env", dict(spec.parameter_env)),
        ("init_from_source", spec.init_from_source),
    )
    for field, value in sent:
        if value:
            raise JobSpecError(
                field,
                value,
                "is computed by the coordinator at Preview, not sent with the intent",
                "Leave it out; `tp submit` never sets it.",
            )
    recipe = catalogue.get(spec.method_id)
    if recipe is None:
        known = ", ".join(sorted(r.method_id for r in catalogue)) or "none"
        raise JobSpecError(
            "method_id",
            spec.method_id,
            "is not a recipe in this coordinator's Catalogue",
            f"Use one of: {known} (see `tp recipe ls`).",
        )
    if recipe.digest != spec.recipe_digest:
        raise JobSpecError(
            "recipe_digest",
            spec.recipe_digest,
            f"is stale: the Catalogue publishes {recipe.method_id} {recipe.version} with digest "
            f"{recipe.digest}",
            f"Run `tp recipe upgrade {spec.experiment}` and preview again.",
        )
    profile, shape_gpus = _profile(spec, config)
    series = config.series[profile.series]
    res = spec.resources
    if res.series and res.series != series.name:
        raise JobSpecError(
            "resources.series",
            res.series,
            f"contradicts the Profile {profile.name}, which runs on Series {series.name}",
            f"Leave resources.series empty or pick a Profile on Series {res.series}.",
        )
    if shape_gpus is not None and shape_gpus != res.gpus:
        raise JobSpecError(
            "resources.gpus",
            res.gpus,
            f"contradicts the Profile shape {res.profile} ({shape_gpus} GPUs)",
            "Ask for the same number of GPUs in both places.",
        )
    if not series.accelerator and res.gpus:
        raise JobSpecError(
            "resources.gpus",
            res.gpus,
            f"the Series {series.name} of Profile {profile.name} has no GPUs",
            "Ask for 0 GPUs or use a GPU Profile.",
        )
    if series.cards and res.gpus > series.cards:
        raise JobSpecError(
            "resources.gpus",
            res.gpus,
            f"exceeds the {series.cards} cards of Series {series.name} in this deployment",
            f"Ask for at most {series.cards} GPUs.",
        )
    gpus_per_member = res.gpus_per_member
    if gpus_per_member is None and res.members is None and profile.gpus_per_member is not None:
        gpus_per_member = profile.gpus_per_member
    members = res.members
    if members is not None and res.gpus % members:
        raise JobSpecError(
            "resources.members",
            members,
            f"does not divide the {res.gpus} GPUs evenly; every member gets the same number",
            "Pick a member count that divides the GPU count.",
        )
    if gpus_per_member is not None and gpus_per_member and res.gpus % gpus_per_member:
        raise JobSpecError(
            "resources.gpus",
            res.gpus,
            f"is not a multiple of {gpus_per_member} GPUs per member (Profile {profile.name})",
            f"Ask for a multiple of {gpus_per_member} GPUs.",
        )
    if gpus_per_member and res.gpus // gpus_per_member > 32:
        raise JobSpecError(
            "resources.gpus",
            res.gpus,
            f"would need {res.gpus // gpus_per_member} members; a Resource Pool has at most 32",
            "Ask for fewer GPUs or more GPUs per member.",
        )
    env: dict[str, str] = dict(profile.env)
    env.update(spec.env)
    parameters = _parameters(spec, recipe)
    _check_entrypoint_file(spec, recipe, parameters)
    try:
        command, parameter_env = workload_command(spec.entrypoint, recipe.passing, parameters)
    except ParameterError as exc:
        field = f"parameters.{exc.name}"
        raise JobSpecError(field, parameters.get(exc.name), exc.why, exc.fix) from None
    resolved = attrs.evolve(
        spec,
        runtime_id=spec.runtime_id or recipe.runtime_id,
        resources=attrs.evolve(res, series=series.name, gpus_per_member=gpus_per_member),
        parameters=parameters,
        env=dict(sorted(env.items())),
        command=command,
        parameter_env=parameter_env,
    )
    validate(resolved)
    check_loader_policy(resolved, config.loader_env_runtimes)
    image = image_runtime(resolved.runtime_id)
    if image is not None:
        registry_for(image, resolved.runtime_id, profile.fleet, config.fleets.get(profile.fleet))
    fixed_members = members
    if fixed_members is None and gpus_per_member:
        fixed_members = res.gpus // gpus_per_member
    summary = PreviewSummary(
        fleet=profile.fleet,
        backend=BACKEND,
        series=series.name,
        gpus_per_member=(gpus_per_member or 0)
        if members is None
        else (res.gpus // members if members else 0),
        members=fixed_members or 0,
        profile=res.profile,
    )
    return Resolved(resolved, summary)
