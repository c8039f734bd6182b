"""The JobSpec's rules no type can express: names, bounds, env, source files (:func:`validate`).

Rules: form only, knowing no site (site policy stays with whoever applies it: the coordinator's
:func:`tuneplane.coordinator.jobspec.check_loader_policy`, the Node's
:mod:`tuneplane.agent.launch_plan`); the first violation is a :class:`.JobSpecError` naming the
field. Part of the protocol's contract: imports nothing from a daemon.
"""

from __future__ import annotations

import base64
import posixpath
import re
from collections.abc import Mapping

from .input_checks import (
    InputRefused,
    check_env,
    check_file_name,
    check_json,
    check_text,
    text_problem,
)
from .jobspec_values import API_VERSION, JobSpec, JobSpecError

MAX_MEMBERS = 32
MAX_SOURCE_BYTES = 8 * 1024 * 1024
# Bounds on the JSON itself, checked before any field is read: nesting (objects and lists) and
# integers (what SQLite and every int64 on the wire can hold).
MAX_JSON_DEPTH = 32
INT_BOUND = 2**63
MAX_ENV_VARS = 256
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
# ``parameter_env``: the TUNEPLANE_PARAM_* variables the coordinator renders from a recipe's
# parameters at Preview (tuneplane.coordinator.parameters). Its names, after escaping, are only
# these; Linux passes at most 128 KiB per argument, and a value has the JobSpec's own limit.
PARAMETER_ENV_PREFIX = "TUNEPLANE_PARAM_"
PARAMETER_ENV_NAME = re.compile(r"^TUNEPLANE_PARAM_[A-Z0-9_]{1,200}$")
MAX_PARAMETER_CHARS = 32 * 1024


def validate(spec: JobSpec) -> None:
    """Check the rules no type can express. Raises :class:`JobSpecError` on the first violation."""
    if spec.api_version != API_VERSION:
        raise JobSpecError(
            "api_version",
            spec.api_version,
            f"only {API_VERSION} is understood",
            "Upgrade `tp` or the coordinator so both speak the same version.",
        )
    for field in ("project", "experiment"):
        value = getattr(spec, field)
        if not _NAME.match(value):
            raise JobSpecError(
                field,
                value,
                "must be 1-63 lowercase letters, digits, '.', '_' or '-'",
                f"Rename the {field}.",
            )
    if spec.method_id.count("/") != 1 or not all(spec.method_id.split("/")):
        raise JobSpecError(
            "method_id",
            spec.method_id,
            "must look like <framework>/<method>",
            "Use a method id from `tp recipe ls`, e.g. custom/custom.",
        )
    if not spec.entrypoint:
        raise JobSpecError("entrypoint", spec.entrypoint, "is empty", "Name the program to run.")
    res = spec.resources
    if res.gpus < 0:
        raise JobSpecError("resources.gpus", res.gpus, "must be zero or more", "Ask for >= 0 GPUs.")
    if res.members is not None and not 1 <= res.members <= MAX_MEMBERS:
        raise JobSpecError(
            "resources.members",
            res.members,
            f"a Resource Pool on the Node backend has 1 to {MAX_MEMBERS} members",
            f"Ask for at most {MAX_MEMBERS} members (one per Node).",
        )
    if res.gpus_per_member is not None and res.gpus_per_member < 0:
        raise JobSpecError(
            "resources.gpus_per_member",
            res.gpus_per_member,
            "must be zero or more",
            "Ask for >= 0 GPUs per member.",
        )
    if (
        res.members is not None
        and res.gpus_per_member is not None
        and res.members * res.gpus_per_member != res.gpus
    ):
        raise JobSpecError(
            "resources.gpus",
            res.gpus,
            f"does not equal members ({res.members}) x gpus_per_member ({res.gpus_per_member})",
            "Make the three agree, or leave members and gpus_per_member out.",
        )
    if not 0 <= spec.grace_period_s <= 3600:
        raise JobSpecError(
            "grace_period_s",
            spec.grace_period_s,
            "must be between 0 and 3600 seconds",
            "Pick a grace period of at most an hour.",
        )
    _check_strings(spec)
    _check_share_with(spec.share_with)
    _check_init_from_source(spec)
    if len(spec.env) > MAX_ENV_VARS:
        raise JobSpecError(
            "env",
            f"{len(spec.env)} variables",
            f"holds more than {MAX_ENV_VARS} variables",
            "Pass fewer environment variables (put settings in a file in the experiment).",
        )
    for key, value in spec.env.items():
        try:
            check_env(key, value)
        except InputRefused as exc:
            raise JobSpecError(exc.field, value, exc.why, exc.fix) from None
    _check_parameter_env(spec.parameter_env)
    total = 0
    for name, content in spec.source_files.items():
        try:
            check_file_name(name, "source_files")
        except InputRefused as exc:
            shown = name if text_problem(name) is None else repr(name[:80])
            raise JobSpecError(
                f"source_files.{shown}",
                name,
                exc.why,
                "Keep experiment files inside experiments/<name>/ under plain relative names.",
            ) from None
        try:
            total += len(base64.b64decode(content, validate=True))
        except ValueError:
            raise JobSpecError(
                f"source_files.{name}",
                content[:16],
                "is not valid base64",
                "Rebuild the JobSpec with `tp submit`.",
            ) from None
    if total > MAX_SOURCE_BYTES:
        raise JobSpecError(
            "source_files",
            f"{total} bytes",
            f"exceeds the {MAX_SOURCE_BYTES} byte limit",
            "Keep datasets and checkpoints out of the experiment directory.",
        )


def _check_parameter_env(env: Mapping[str, str]) -> None:
    """Only TUNEPLANE_PARAM_* names, as :func:`tuneplane.coordinator.parameters.env_name`
    writes them."""
    if len(env) > MAX_ENV_VARS:
        raise JobSpecError(
            "parameter_env",
            f"{len(env)} variables",
            f"holds more than {MAX_ENV_VARS} variables",
            "Let the coordinator fill it at Preview.",
        )
    for key, value in env.items():
        if not PARAMETER_ENV_NAME.match(key):
            raise JobSpecError(
                f"parameter_env.{key[:80]}",
                value,
                "is not a TUNEPLANE_PARAM_<NAME> variable (upper-case letters, digits, '_')",
                "Let the coordinator fill parameter_env at Preview.",
            )
        try:
            check_text(value, f"parameter_env.{key}", MAX_PARAMETER_CHARS)
        except InputRefused as exc:
            raise JobSpecError(exc.field, value, exc.why, exc.fix) from None


MAX_SHARE_WITH = 100


def _check_init_from_source(spec: JobSpec) -> None:
    """The Derivation's source, as Preview resolved it: for the run ``init_from`` names, an
    absolute normalised out_dir and a sha256 manifest digest (the Node copies and checks it)."""
    source = spec.init_from_source
    if source is None:
        return
    field = "init_from_source"
    if spec.init_from != source.run_id:
        raise JobSpecError(
            f"{field}.run_id",
            source.run_id,
            f"does not match init_from ({spec.init_from!r})",
            "Preview again; the coordinator fills init_from_source from init_from.",
        )
    out = source.out_dir
    if not out.startswith("/") or posixpath.normpath(out) != out or "\0" in out:
        raise JobSpecError(
            f"{field}.out_dir", out, "is not an absolute, normalised path", "Preview again."
        )
    if not re.fullmatch(r"[0-9a-f]{64}", source.manifest_sha256):
        raise JobSpecError(
            f"{field}.manifest_sha256",
            source.manifest_sha256,
            "is not a sha256 digest (64 lowercase hex digits)",
            "Preview again.",
        )


def _check_share_with(names: tuple[str, ...]) -> None:
    if len(names) > MAX_SHARE_WITH:
        raise JobSpecError(
            "share_with",
            f"{len(names)} users",
            f"names more than {MAX_SHARE_WITH} users",
            "Share the project with fewer users.",
        )
    for n, name in enumerate(names):
        if not _NAME.match(name):
            raise JobSpecError(
                f"share_with[{n}]",
                name,
                "is not a user name (1-63 lowercase letters, digits, '.', '_' or '-')",
                "Fix the name in share_with in tuneplane.yaml.",
            )


def _check_strings(spec: JobSpec) -> None:
    """Every string of the JobSpec is plain text: no NUL, no lone surrogate (named by field)."""
    try:
        for field in ("project", "experiment", "method_id", "recipe_digest", "runtime_id"):
            check_text(getattr(spec, field), field)
        for i, arg in enumerate(spec.entrypoint):
            check_text(arg, f"entrypoint[{i}]")
        for i, arg in enumerate(spec.command):
            check_text(arg, f"command[{i}]")
        check_text(spec.resources.profile, "resources.profile")
        check_text(spec.resources.series, "resources.series")
        if spec.init_from is not None:
            check_text(spec.init_from, "init_from")
        check_json(dict(spec.parameters), "parameters", MAX_JSON_DEPTH, INT_BOUND)
    except InputRefused as exc:
        raise JobSpecError(exc.field, None, exc.why, exc.fix) from None
