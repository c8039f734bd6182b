"""The JobSpec (``tuneplane/v1``): the JSON ``tp`` builds, the coordinator admits and a Node runs.

Rules:
- One converter (:func:`make_converter`) reads JobSpec JSON; unknown keys are errors, and every
  error names the field path, the value, why it is wrong and how to fix it (:class:`JobSpecError`).
- The digest is sha256 over the *canonical* JSON (sorted keys, no whitespace, UTF-8), so the same
  intent always has the same digest and any edit, however small, changes it.
- Parsing (:func:`loads`, :func:`parse`, :func:`validate`) checks form and knows no site: ``tp``
  builds with it, the coordinator admits with it and the Node reads a Prepare's JobSpec with it.
  Site policy is separate and stays with whoever applies it: the coordinator's is
  :func:`tuneplane.coordinator.jobspec.check_loader_policy`, the Node's
  :mod:`tuneplane.agent.launch_plan`.
- Part of the protocol's contract (:mod:`tuneplane.proto.contract`): imports nothing from the
  coordinator, the agent, the collector or the runner.
"""

from __future__ import annotations

import base64
import hashlib
import json
import posixpath
import re
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError

from tuneplane.proto.contract.derivation_source import InitFromSource
from tuneplane.proto.contract.input_checks import (
    InputRefused,
    bounded_int,
    check_env,
    check_file_name,
    check_json,
    check_text,
    text_problem,
)

API_VERSION = "tuneplane/v1"
MAX_MEMBERS = 32
MAX_SOURCE_BYTES = 8 * 1024 * 1024
# Bounds on the JSON itself, checked before any field is read: nesting (objects and lists) and
# integers (what SQLite and every int64 on the wire can hold).
MAX_JSON_DEPTH = 32
INT_BOUND = 2**63
_INT_DIGITS = len(str(INT_BOUND))
MAX_ENV_VARS = 256
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
# ``parameter_env``: the TUNEPLANE_PARAM_* variables the coordinator renders from a recipe's
# parameters at Preview (tuneplane.coordinator.parameters). Its names, after escaping, are only
# these; Linux passes at most 128 KiB per argument, and a value has the JobSpec's own limit.
PARAMETER_ENV_PREFIX = "TUNEPLANE_PARAM_"
PARAMETER_ENV_NAME = re.compile(r"^TUNEPLANE_PARAM_[A-Z0-9_]{1,200}$")
MAX_PARAMETER_CHARS = 32 * 1024


class JobSpecError(ValueError):
    """A JobSpec field is wrong. ``str()`` is a sentence a researcher can act on."""

    def __init__(self, field: str, value: object, why: str, fix: str) -> None:
        self.field = field
        self.value = value
        self.why = why
        self.fix = fix
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        super().__init__(f"JobSpec field '{field}' = {shown}: {why}. {fix}")

    def __reduce__(self) -> tuple[Callable[..., JobSpecError], tuple[str, str, str, str]]:
        # Raised in a worker process too (the coordinator's message_limits.in_process) and
        # pickled back to the event loop: the value goes as its shown text, so a refused 15 MiB
        # list costs nothing.
        return (_unpickled_error, (self.field, self.why, self.fix, str(self)))


def _unpickled_error(field: str, why: str, fix: str, message: str) -> JobSpecError:
    """A :class:`JobSpecError` back from a worker process; ``value`` is its shown text."""
    error = JobSpecError.__new__(JobSpecError)
    ValueError.__init__(error, message)
    error.field, error.why, error.fix = field, why, fix
    error.value = message.partition(" = ")[2].partition(f": {why}. ")[0]
    return error


@attrs.frozen
class Resources:
    """What the Job asks for: ``gpus`` cards of one Series, in one homogeneous Resource Pool.

    ``members`` and ``gpus_per_member`` are optional: when absent, placement uses as few members
    as the Nodes' free healthy GPUs allow, every member with the same number of GPUs.
    """

    profile: str
    series: str
    gpus: int
    members: int | None = None
    gpus_per_member: int | None = None


@attrs.frozen
class JobSpec:
    api_version: str
    project: str
    experiment: str
    method_id: str
    recipe_digest: str
    runtime_id: str
    entrypoint: tuple[str, ...]
    resources: Resources
    parameters: Mapping[str, Any] = attrs.field(factory=dict)
    env: Mapping[str, str] = attrs.field(factory=dict)
    grace_period_s: int = 30
    init_from: str | None = None
    # Experiment files, relative path -> base64 content; materialised in the member's work dir.
    source_files: Mapping[str, str] = attrs.field(factory=dict)
    # TunePlane users besides the owner who may read this Job (state, logs, metrics): the
    # project's `share_with` in tuneplane.yaml. Reading only; changing a Job stays the owner's.
    share_with: tuple[str, ...] = ()
    # Filled by the coordinator at Preview, never by the intent (tuneplane.coordinator.parameters):
    # what every rank execs (the entrypoint, placeholders filled, then the recipe's parameter
    # flags) and the TUNEPLANE_PARAM_* variables it gets. The digest covers both; the Node runs
    # them as they are. Empty in a JobSpec admitted before they existed.
    command: tuple[str, ...] = ()
    parameter_env: Mapping[str, str] = attrs.field(factory=dict)
    # Filled by the coordinator at Preview from ``init_from`` (tuneplane.coordinator.derivation):
    # the source artifact, its place and its manifest's digest, so the digest covers which bytes
    # the run begins from. None without a Derivation (and absent from the JSON then).
    init_from_source: InitFromSource | None = None


def make_converter() -> cattrs.Converter:
    """The converter for JobSpec JSON: typos are errors, tuples stay tuples."""
    conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)

    # cattrs would turn 1 into "1" and "8" into 8; a JobSpec must say what it means.
    def exact(kind: type) -> Any:
        def hook(value: object, _: type) -> object:
            if type(value) is not kind:
                raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
            return value

        return hook

    conv.register_structure_hook(str, exact(str))
    conv.register_structure_hook(int, exact(int))
    conv.register_structure_hook(bool, exact(bool))
    return conv


_CONVERTER = make_converter()


def _first_error(exc: Exception) -> tuple[str, str]:
    """cattrs reports ``why @ $.path.to[0].field``; take the first as (field path, why)."""
    for line in cattrs.transform_error(exc):
        why, _, where = line.rpartition(" @ ")
        path = where.removeprefix("$").removeprefix(".")
        extra = re.fullmatch(r"extra fields found \((.+)\)", why)
        if extra:
            # Name the unknown key itself, so the error points at the typo, not its parent.
            key = extra.group(1).split(", ")[0]
            return (f"{path}.{key}" if path else key), "is not a JobSpec field"
        return path or "<root>", why or line
    return "<root>", str(exc)


def _lookup(raw: object, path: str) -> object:
    node: object = raw
    for part in re.findall(r"[^.\[\]]+", path):
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list | tuple) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def parse(raw: Mapping[str, Any]) -> JobSpec:
    """Build and validate a JobSpec from decoded JSON. Raises :class:`JobSpecError`."""
    if not isinstance(raw, Mapping):
        raise JobSpecError("<root>", raw, "a JobSpec is a JSON object", "Send a JSON object.")
    shared = raw.get("share_with", [])
    if not isinstance(shared, list):
        # cattrs would read the string "bob" as the names ("b", "o", "b").
        raise JobSpecError(
            "share_with", shared, "must be a list of user names", "Write share_with: [name, ...]."
        )
    try:
        spec = _CONVERTER.structure(dict(raw), JobSpec)
    except (ClassValidationError, IterableValidationError, ForbiddenExtraKeysError) as exc:
        path, why = _first_error(exc)
        raise JobSpecError(
            path, _lookup(raw, path), why, "Rebuild the JobSpec with `tp submit`."
        ) from None
    except (TypeError, ValueError) as exc:
        raise JobSpecError(
            "<root>", None, str(exc), "Rebuild the JobSpec with `tp submit`."
        ) from None
    validate(spec)
    return spec


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


def to_json_obj(spec: JobSpec) -> dict[str, Any]:
    """The JobSpec as plain JSON data (lists, dicts, str, int, None)."""
    data = _CONVERTER.unstructure(spec)
    data["entrypoint"] = list(spec.entrypoint)
    if not spec.share_with:
        # Absent when empty, so a JobSpec that shares with nobody keeps the digest it had
        # before the field existed.
        del data["share_with"]
    else:
        data["share_with"] = list(spec.share_with)
    # Absent when empty too: an intent has neither, and an older resolved JobSpec keeps its digest.
    if spec.command:
        data["command"] = list(spec.command)
    else:
        del data["command"]
    if not spec.parameter_env:
        del data["parameter_env"]
    if spec.init_from_source is None:
        del data["init_from_source"]
    elif not spec.init_from_source.node_id:
        del data["init_from_source"]["node_id"]
    return json.loads(json.dumps(data))  # type: ignore[no-any-return]


def canonical_json(spec: JobSpec) -> str:
    """Sorted keys, no insignificant whitespace: equal intents give equal bytes."""
    return json.dumps(to_json_obj(spec), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def digest(spec: JobSpec) -> str:
    """``sha256:<hex>`` of :func:`canonical_json`."""
    return digest_of(canonical_json(spec).encode("utf-8"))


def digest_of(canonical: bytes) -> str:
    """``sha256:<hex>`` of canonical JSON already encoded as UTF-8 (see :func:`digest`)."""
    return "sha256:" + hashlib.sha256(canonical).hexdigest()


def loads(text: str) -> JobSpec:
    """Parse JobSpec JSON text; a syntax error is a :class:`JobSpecError` too."""
    try:
        raw = json.loads(
            text,
            parse_int=lambda digits: bounded_int(digits, _INT_DIGITS),
            parse_constant=_no_constant,
        )
    except json.JSONDecodeError as exc:
        raise JobSpecError(
            "<root>",
            text[:40],
            f"is not JSON ({exc.msg} at line {exc.lineno})",
            "Send the JSON that `tp` builds.",
        ) from None
    except RecursionError:
        raise JobSpecError(
            "<root>",
            text[:40],
            f"nests deeper than {MAX_JSON_DEPTH} levels of objects and lists",
            "Send the JSON that `tp` builds.",
        ) from None
    except ValueError as exc:
        # parse_constant's refusal, or a float the decoder cannot read.
        raise JobSpecError(
            "<root>", text[:40], str(exc), "Send the JSON that `tp` builds."
        ) from None
    try:
        check_json(raw, "<root>", MAX_JSON_DEPTH, INT_BOUND)
    except InputRefused as exc:
        raise JobSpecError(exc.field, _lookup(raw, exc.field), exc.why, exc.fix) from None
    return parse(raw)


def _no_constant(name: str) -> float:
    raise ValueError(f"holds {name}, which is not JSON (no NaN or Infinity)")


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
