"""How a recipe's parameters reach the workload: argv flags and ``TUNEPLANE_PARAM_*`` variables.

Rules:
- A recipe declares it (``pass_parameters`` in its JSON, read by :func:`passing_of`): ``argv``
  lists parameter names in the order their flags follow the entrypoint, each flag ``--<name>``
  unless the parameter sets its own ``flag``; ``env`` lists the parameters exported as
  ``TUNEPLANE_PARAM_<NAME>`` (or is ``"all"``). A parameter may be passed both ways, or neither
  (it then only fills ``{name}`` placeholders of the entrypoint).
- :func:`render` is the one place a parameter value becomes text. The coordinator calls it once,
  at Preview, and stores what it returns in the resolved JobSpec (``command``, ``parameter_env``),
  so the digest covers it, ``tp submit --preview`` shows it and the Node runs exactly it.
- Pure: no I/O. A value is written as ``str`` as given, ``int`` in decimal, ``float`` as
  Python's shortest round-trip form (``0.001``, ``1e-05``, ``3.0``), ``bool`` as ``true`` or
  ``false``. A parameter with no value (no default and not set) is left out of both.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import attrs

# What a TUNEPLANE_PARAM_* name and value may be is the JobSpec's rule: the Node checks it too.
from tuneplane.proto.contract.jobspec_rules import MAX_PARAMETER_CHARS, PARAMETER_ENV_PREFIX

_PARAM_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,62}$")
_FLAG = re.compile(r"^--?[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_TYPES = ("str", "int", "float", "bool")


class RecipeError(ValueError):
    """A recipe's ``pass_parameters`` is wrong; ``str()`` names the recipe, field and fix."""


class ParameterError(ValueError):
    """A parameter value cannot be passed; ``str()`` is a sentence naming the parameter."""

    def __init__(self, name: str, why: str, fix: str) -> None:
        self.name = name
        self.why = why
        self.fix = fix
        super().__init__(f"parameter '{name}' {why}. {fix}")


@attrs.frozen
class Passing:
    """How one recipe passes its parameters. ``types`` holds every parameter's type."""

    types: Mapping[str, str]
    argv: tuple[tuple[str, str], ...] = ()  # (parameter name, flag), in the order given
    env: tuple[str, ...] = ()  # parameter names exported as TUNEPLANE_PARAM_<NAME>


@attrs.frozen
class Rendered:
    """What the parameters add for every rank: flags after the entrypoint, and variables."""

    argv: tuple[str, ...]
    env: Mapping[str, str]


def env_name(parameter: str) -> str:
    """``learning_rate`` -> ``TUNEPLANE_PARAM_LEARNING_RATE``: upper case, and every character
    that is not a letter, digit or ``_`` (``.``, ``-``) written as ``_``."""
    return PARAMETER_ENV_PREFIX + re.sub(r"[^A-Z0-9_]", "_", parameter.upper())


def value_text(kind: str, value: Any) -> str:
    """The text of one typed value (see the module rules). Raises ``TypeError`` on a mismatch."""
    if kind == "bool" and isinstance(value, bool):
        return "true" if value else "false"
    if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if kind == "float" and isinstance(value, int | float) and not isinstance(value, bool):
        return repr(float(value))
    if kind == "str" and isinstance(value, str):
        return value
    raise TypeError(f"a {kind} parameter cannot hold {value!r} ({type(value).__name__})")


def render(passing: Passing, values: Mapping[str, Any]) -> Rendered:
    """The argv flags and ``TUNEPLANE_PARAM_*`` variables for ``values`` (already typed and
    range-checked). Raises :class:`ParameterError` for a value that cannot be passed."""
    texts: dict[str, str] = {}
    for name, value in values.items():
        kind = passing.types.get(name)
        if kind is None or value is None:
            continue
        try:
            text = value_text(kind, value)
        except TypeError as exc:
            raise ParameterError(name, str(exc), f"Set {name} to a {kind}.") from None
        if len(text) > MAX_PARAMETER_CHARS:
            raise ParameterError(
                name,
                f"is {len(text)} characters long, over the {MAX_PARAMETER_CHARS} a workload can be "
                "passed",
                "Put long values in a file in the experiment and pass its name.",
            )
        texts[name] = text
    argv: list[str] = []
    for name, flag in passing.argv:
        if name in texts:
            argv += [flag, texts[name]]
    env = {env_name(name): texts[name] for name in passing.env if name in texts}
    return Rendered(argv=tuple(argv), env=dict(sorted(env.items())))


def passing_of(method_id: str, raw: object, parameters: Mapping[str, Mapping[str, Any]]) -> Passing:
    """Read a recipe's ``pass_parameters`` against its ``parameters``. Raises :class:`RecipeError`.

    A recipe without parameters may leave ``pass_parameters`` out; one with parameters must say
    how they pass, so no parameter is accepted and then silently dropped.
    """
    where = f"Recipe {method_id}"
    types: dict[str, str] = {}
    for name, param in parameters.items():
        if not _PARAM_NAME.match(name):
            raise RecipeError(
                f"{where}: parameter name {name!r} is not 1-63 letters, digits, '_', '.' or '-' "
                "starting with a letter; rename it."
            )
        kind = param.get("type")
        if kind not in _TYPES:
            raise RecipeError(
                f"{where}: parameter '{name}' has type {kind!r}; use one of {', '.join(_TYPES)}."
            )
        types[name] = str(kind)
    if raw is None:
        if types:
            raise RecipeError(
                f"{where} has parameters but no 'pass_parameters'; declare how they reach the "
                'workload, e.g. "pass_parameters": {"argv": [...], "env": "all"}.'
            )
        return Passing(types=types)
    if not isinstance(raw, Mapping) or set(raw) - {"argv", "env"}:
        raise RecipeError(
            f"{where}: 'pass_parameters' must be an object with only 'argv' and 'env'; fix it."
        )
    argv_names = _names(where, "argv", raw.get("argv", []), types)
    env_raw = raw.get("env", [])
    env_names = tuple(types) if env_raw == "all" else _names(where, "env", env_raw, types)
    argv: list[tuple[str, str]] = []
    for name in argv_names:
        flag = parameters[name].get("flag", f"--{name}")
        if not isinstance(flag, str) or not _FLAG.match(flag):
            raise RecipeError(
                f"{where}: parameter '{name}' has flag {flag!r}; a flag is '-' or '--' and a "
                "name, e.g. --steps."
            )
        argv.append((name, flag))
    if len({flag for _, flag in argv}) != len(argv):
        raise RecipeError(f"{where}: two parameters in 'pass_parameters.argv' share a flag.")
    by_env: dict[str, str] = {}
    for name in env_names:
        other = by_env.setdefault(env_name(name), name)
        if other != name:
            raise RecipeError(
                f"{where}: parameters '{other}' and '{name}' would both be {env_name(name)}; "
                "rename one."
            )
    return Passing(types=types, argv=tuple(argv), env=env_names)


def _names(where: str, key: str, raw: object, types: Mapping[str, str]) -> tuple[str, ...]:
    if not isinstance(raw, list) or not all(isinstance(n, str) for n in raw):
        raise RecipeError(
            f"{where}: 'pass_parameters.{key}' must be a list of parameter names"
            + (' or "all"' if key == "env" else "")
            + "."
        )
    for name in raw:
        if name not in types:
            raise RecipeError(
                f"{where}: 'pass_parameters.{key}' names '{name}', which is not one of its "
                f"parameters ({', '.join(types) or 'none'})."
            )
    if len(set(raw)) != len(raw):
        raise RecipeError(f"{where}: 'pass_parameters.{key}' names a parameter twice.")
    return tuple(raw)


def fill_entrypoint(entrypoint: tuple[str, ...], values: Mapping[str, Any]) -> tuple[str, ...]:
    """The entrypoint with ``{parameter}`` placeholders filled from ``values`` (``str()`` of
    each); an element naming no known parameter stays as written."""
    texts = {name: str(value) for name, value in values.items()}
    filled = []
    for arg in entrypoint:
        try:
            filled.append(arg.format_map(texts))
        except (KeyError, ValueError, IndexError):
            filled.append(arg)
    return tuple(filled)


def workload_command(
    entrypoint: tuple[str, ...], passing: Passing, values: Mapping[str, Any]
) -> tuple[tuple[str, ...], dict[str, str]]:
    """What every rank gets from the recipe and its parameters: the argv (the entrypoint, filled,
    then the parameter flags) and the ``TUNEPLANE_PARAM_*`` variables."""
    rendered = render(passing, values)
    return (*fill_entrypoint(entrypoint, values), *rendered.argv), dict(rendered.env)
