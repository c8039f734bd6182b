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
- The front door of the JobSpec: the values live in :mod:`.jobspec_values`, the rules
  :func:`validate` checks in :mod:`.jobspec_rules`; callers import them from here.
- Part of the protocol's contract (:mod:`tuneplane.proto.contract`): imports nothing from the
  coordinator, the agent, the collector or the runner.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError

from .input_checks import InputRefused, bounded_int, check_json
from .jobspec_rules import INT_BOUND, MAX_JSON_DEPTH
from .jobspec_rules import MAX_MEMBERS as MAX_MEMBERS
from .jobspec_rules import MAX_SOURCE_BYTES as MAX_SOURCE_BYTES
from .jobspec_rules import validate as validate
from .jobspec_values import API_VERSION as API_VERSION
from .jobspec_values import JobSpec as JobSpec
from .jobspec_values import JobSpecError as JobSpecError
from .jobspec_values import Resources as Resources

_INT_DIGITS = len(str(INT_BOUND))


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
