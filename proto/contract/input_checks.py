"""The checks every piece of outside text passes before TunePlane acts on it.

Rules:
- One function per rule, used on every side: :func:`check_file_name` is what ``tp`` applies when
  it collects an experiment, what the coordinator applies at Preview and what the agent applies
  at Prepare; :func:`check_text` and :func:`check_message` are what every wire edge applies
  to decoded messages and strings; :func:`check_env` is the one rule for the form of a JobSpec's
  environment, and :func:`loader_refusal` the one policy rule for loader variables (a site's
  policy, so it is kept out of parsing: the coordinator and the Node each apply their own).
- Every refusal is an :class:`InputRefused` naming the field, what is wrong and how to fix it.
  Nothing here does I/O; callers wrap the refusal into their own error type.
- Part of the protocol's contract (:mod:`tuneplane.proto.contract`): ``tp``, the coordinator and
  the Node import it from here, and it imports nothing of theirs.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import PurePosixPath
from typing import Any

import betterproto

MAX_FILE_NAME_CHARS = 1024
MAX_FILE_NAME_PART_BYTES = 255
MAX_ENV_NAME_CHARS = 256
MAX_ENV_VALUE_CHARS = 32 * 1024
# Variables that make the dynamic loader or the Python interpreter load code the Node did not
# choose. A JobSpec sets them only for a runtime that both coordinator.toml and the Node's
# node.toml allow them for (``allow_loader_env = true``).
LOADER_VARIABLES = frozenset(
    {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "PYTHONEXECUTABLE"}
)
LOADER_PREFIXES = ("LD_", "DYLD_")

_SURROGATE = re.compile("[\ud800-\udfff]")
_CONTROL = re.compile("[\x00-\x1f\x7f]")
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SEARCH_CHARS = 256 * 1024


class InputRefused(ValueError):
    """Outside input breaks a rule. ``str()`` is a sentence: the field, the problem, the fix."""

    def __init__(self, field: str, why: str, fix: str) -> None:
        self.field = field
        self.why = why
        self.fix = fix
        super().__init__(f"{field} {why}. {fix}")


def text_problem(value: str) -> str | None:
    """Why ``value`` cannot be stored or passed on (a NUL or a lone surrogate), or ``None``."""
    if "\x00" in value:
        return "contains a NUL character (\\0)"
    if value.isascii():  # known without reading the text: no surrogate can be in it
        return None
    # Searched in slices, so a 16 MiB string never holds the interpreter for one long call (it
    # may run in a worker thread beside the event loop).
    for start in range(0, len(value), _SEARCH_CHARS):
        found = _SURROGATE.search(value, start, start + _SEARCH_CHARS)
        if found:
            return (
                f"contains a lone surrogate (U+{ord(found.group()):04X}), which is not valid "
                "Unicode"
            )
    return None


def check_text(value: str, field: str, max_chars: int | None = None) -> None:
    """Refuse a NUL, a lone surrogate, or more than ``max_chars`` characters."""
    problem = text_problem(value)
    if problem is not None:
        raise InputRefused(field, problem, "Send plain UTF-8 text without NUL characters.")
    if max_chars is not None and len(value) > max_chars:
        raise InputRefused(
            field, f"is {len(value)} characters long, over the limit of {max_chars}", "Shorten it."
        )


def check_file_name(name: str, field: str = "file name") -> PurePosixPath:
    """The one rule for a file name inside an experiment or a capsule; returns it as a path.

    A name is a plain relative POSIX path: not empty, no leading ``/``, no ``.``, ``..`` or empty
    parts, no backslash, no control character or NUL, valid Unicode, at most
    ``MAX_FILE_NAME_CHARS`` characters and ``MAX_FILE_NAME_PART_BYTES`` bytes per part.
    """
    fix = "Rename the file to a plain relative path inside the experiment, e.g. src/train.py."
    shown = f"{field} {name[:80]!r}"

    def refused(detail: str) -> InputRefused:
        return InputRefused(shown, f"is not a plain relative path: it {detail}", fix)

    if not name:
        raise InputRefused(field, "is not a plain relative path: it is empty", fix)
    problem = text_problem(name)
    if problem is not None:
        raise refused(problem)
    if _CONTROL.search(name):
        raise refused("contains a control character")
    if len(name) > MAX_FILE_NAME_CHARS:
        raise refused(f"is longer than {MAX_FILE_NAME_CHARS} characters")
    if name.startswith("/"):
        raise refused("starts with /")
    if "\\" in name:
        raise refused("contains a backslash")
    parts = name.split("/")
    for part in parts:
        if part in ("", ".", ".."):
            raise refused("has an empty, '.' or '..' part")
        if len(part.encode("utf-8")) > MAX_FILE_NAME_PART_BYTES:
            raise refused(f"has a part longer than {MAX_FILE_NAME_PART_BYTES} bytes")
    return PurePosixPath(*parts)


def is_loader_variable(name: str) -> bool:
    """True for ``LD_PRELOAD``, ``LD_LIBRARY_PATH``, ``PYTHONPATH`` and their kin."""
    return name in LOADER_VARIABLES or name.startswith(LOADER_PREFIXES)


#: Variables the Node sets for every member (agent/members_launch.py), which a Job cannot set.
SET_BY_TUNEPLANE = frozenset({"TENSORBOARD_LOGDIR", "AIP_TENSORBOARD_LOG_DIR"})
#: What to do instead of setting a ``TUNEPLANE_*`` or :data:`SET_BY_TUNEPLANE` variable.
SET_BY_TUNEPLANE_FIX = (
    "TunePlane sets it for every member: read $TUNEPLANE_OUT_DIR, $TUNEPLANE_TELEMETRY_DIR or "
    "$TENSORBOARD_LOGDIR in the script instead (TensorBoard and tuneplane.report files anywhere "
    "under $TUNEPLANE_OUT_DIR are collected), and pass your own settings under another name "
    "(docs/researcher.md, 'What a member gets')"
)


def check_env(name: str, value: str, field: str = "env") -> None:
    """The one rule for the form of an environment variable a JobSpec asks for.

    Form only (a valid name, not ``TUNEPLANE_*``, plain text of bounded length): whether a loader
    variable may be set is site policy, decided by :func:`loader_refusal`.
    """
    where = f"{field}.{name[:80]}"
    if not _ENV_NAME.fullmatch(name) or len(name) > MAX_ENV_NAME_CHARS:
        raise InputRefused(
            where,
            "is not a valid environment variable name (letters, digits and '_', not starting "
            f"with a digit, at most {MAX_ENV_NAME_CHARS} characters; no '=' or NUL)",
            "Rename the variable.",
        )
    if name.startswith("TUNEPLANE_"):
        raise InputRefused(where, "uses the reserved TUNEPLANE_ prefix", f"{SET_BY_TUNEPLANE_FIX}.")
    if name in SET_BY_TUNEPLANE:
        raise InputRefused(where, "cannot be set by a Job", f"{SET_BY_TUNEPLANE_FIX}.")
    check_text(value, where, MAX_ENV_VALUE_CHARS)


def loader_refusal(
    env: Mapping[str, str], runtime_id: str, allowed: bool, how_to_allow: str, field: str = "env"
) -> InputRefused | None:
    """The refusal of the first loader variable (by name) ``env`` sets, or ``None``.

    ``allowed`` is the site's word for ``runtime_id`` (coordinator.toml at Preview, node.toml at
    Prepare); ``how_to_allow`` finishes the fix, e.g. "ask the Node's operator to set ...".
    """
    if allowed:
        return None
    for name in sorted(env):
        if is_loader_variable(name):
            shown = runtime_id or "(no runtime named)"
            return InputRefused(
                f"{field}.{name}",
                "is a loader variable: it changes which libraries or Python modules the "
                f"workload loads, and the runtime {shown} does not allow loader variables",
                f"Remove it from the env (put the libraries in the experiment), or {how_to_allow}.",
            )
    return None


# -- decoded protocol messages --------------------------------------------------------------------

# What a decoded field must hold, by proto type. betterproto decodes a field sent with the wrong
# wire type (or a group) into the wrong Python type or None instead of refusing it.
_PY_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str,
    "bytes": bytes,
    "bool": bool,
    "double": float,
    "float": float,
    "enum": int,
    "message": betterproto.Message,
    **{
        kind: int
        for kind in (
            "int32", "int64", "uint32", "uint64", "sint32", "sint64",
            "fixed32", "fixed64", "sfixed32", "sfixed64",
        )
    },
}  # fmt: skip

_Spec = tuple[tuple[str, str, bool, tuple[str, str] | None], ...]
_SPECS: dict[type, _Spec] = {}


def _spec(cls: type) -> _Spec:
    """(name, proto type, repeated, map types) of every field of a generated class, cached."""
    spec = _SPECS.get(cls)
    if spec is None:
        info: Any = getattr(cls, "_betterproto")  # noqa: B009 - betterproto's loose typing
        spec = tuple(
            (
                name,
                meta.proto_type,
                isinstance(info.default_gen[name](), list),
                meta.map_types,
            )
            for name, meta in info.meta_by_field_name.items()
        )
        _SPECS[cls] = spec
    return spec


def _value_problem(value: object, kind: str) -> str | None:
    expected = _PY_TYPES.get(kind)
    if expected is None or isinstance(value, expected):
        return None
    if kind in ("double", "float") and type(value) is int:
        return None
    return f"does not hold a valid {kind} (the bytes are not this message)"


def _problems(msg: betterproto.Message, path: str, text: bool) -> Iterator[tuple[str, str]]:
    """(field path, problem) for every field of ``msg`` of the wrong type or with bad text."""
    given = vars(msg)
    for name, kind, repeated, map_types in _spec(type(msg)):
        # Read as stored: a field never given (or a member of a oneof that another member holds)
        # is betterproto's PLACEHOLDER, its default, which has nothing to check, and reading it
        # through the message would build that default.
        value = given.get(name, betterproto.PLACEHOLDER)
        if value is betterproto.PLACEHOLDER:
            continue
        where = f"{path}.{name}"
        if kind == "map":
            if not isinstance(value, dict):
                yield where, "does not hold a valid map (the bytes are not this message)"
                continue
            key_kind, value_kind = map_types or ("string", "string")
            for key, item in value.items():
                problem = _value_problem(key, key_kind) or _value_problem(item, value_kind)
                if problem is None and text and isinstance(key, str):
                    problem = text_problem(key)
                if problem is None and text and isinstance(item, str):
                    problem = text_problem(item)
                if problem is not None:
                    yield f"{where}[{key!r}]", problem
                elif isinstance(item, betterproto.Message):
                    yield from _problems(item, f"{where}[{key!r}]", text)
            continue
        items = value if repeated else [value]
        if repeated and not isinstance(value, list):
            yield where, "does not hold a valid repeated field (the bytes are not this message)"
            continue
        for i, item in enumerate(items):
            at = f"{where}[{i}]" if repeated else where
            problem = _value_problem(item, kind)
            if problem is None and text and isinstance(item, str):
                problem = text_problem(item)
            if problem is not None:
                yield at, problem
            elif isinstance(item, betterproto.Message) and (
                repeated or betterproto.serialized_on_wire(item)
            ):
                yield from _problems(item, at, text)


def check_message(msg: betterproto.Message, *, text: bool = True) -> None:
    """Refuse a decoded message with a field of the wrong type or, with ``text``, a string
    holding a NUL or a lone surrogate; the :class:`InputRefused` names the field."""
    for where, problem in _problems(msg, type(msg).__name__, text):
        raise InputRefused(
            where,
            problem,
            "Send a valid message: plain UTF-8 text without NUL characters in every field.",
        )


def printable(value: str) -> str:
    """``value`` safe to print on a terminal: control characters (an escape sequence could
    rewrite the screen) and lone surrogates become ``\\xNN`` / ``\\uNNNN`` text."""
    if not _UNPRINTABLE.search(value):
        return value
    return _UNPRINTABLE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), value)


def printable_message(msg: betterproto.Message) -> None:
    """Make every string of a decoded reply :func:`printable`, in place, before it is shown."""
    for name, *_ in _spec(type(msg)):
        try:
            value = getattr(msg, name)
        except AttributeError:
            continue
        if isinstance(value, str):
            setattr(msg, name, printable(value))
        elif isinstance(value, betterproto.Message):
            printable_message(value)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, str):
                    value[i] = printable(item)
                elif isinstance(item, betterproto.Message):
                    printable_message(item)
        elif isinstance(value, dict):
            for key, item in list(value.items()):
                if isinstance(item, str):
                    value[key] = printable(item)
                elif isinstance(item, betterproto.Message):
                    printable_message(item)


# -- decoded JSON -----------------------------------------------------------------------------


class HugeInt(str):
    """A JSON integer with too many digits to convert; kept as text so its field can be named."""


def bounded_int(text: str, max_digits: int) -> int | HugeInt:
    """A ``json.loads(parse_int=...)`` hook: converts at most ``max_digits`` digits."""
    if len(text.lstrip("-")) > max_digits:
        return HugeInt(text)
    return int(text)


def check_json(value: Any, field: str, max_depth: int, int_bound: int, depth: int = 0) -> None:
    """Walk decoded JSON: depth, integer size (``|i| < int_bound``) and every string and key."""
    if depth > max_depth:
        raise InputRefused(
            field,
            f"nests deeper than {max_depth} levels of objects and lists",
            "Flatten the value.",
        )
    if isinstance(value, HugeInt):
        raise InputRefused(
            field,
            f"is an integer with {len(value.lstrip('-'))} digits, beyond the limit of "
            f"{int_bound:.3g}",
            "Use a smaller number (or a string).",
        )
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return
    if isinstance(value, int):
        if not -int_bound < value < int_bound:
            raise InputRefused(
                field,
                f"is an integer beyond the limit of +/-{int_bound}",
                "Use a smaller number (or a string).",
            )
        return
    if isinstance(value, str):
        check_text(value, field)
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            where = f"{field}.{key}" if field != "<root>" else str(key)
            check_text(str(key), where)
            check_json(item, where, max_depth, int_bound, depth + 1)
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            check_json(item, f"{field}[{i}]", max_depth, int_bound, depth + 1)
