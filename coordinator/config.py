"""``coordinator.toml``: the Series and Profiles this coordinator knows, read with tomllib.

Rules:
- The file is written once by ``tuneplane-coordinator init`` and edited by the people who run the
  coordinator; a typo is a :class:`ConfigError` naming the file, the key and the fix.
- A Profile is a preset over exactly one Series; it never invents hardware the Series lacks.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

CONFIG_NAME = "coordinator.toml"

DEFAULT_CONFIG = """\
# TunePlane coordinator configuration: the Series (classes of accelerator) and the Profiles
# (named presets over a Series) that `tp submit --profile` takes.
#
# [series.<name>]
#   card_memory_gib   per-card memory
#   scheduling_pin    the label a Node's GPUs carry for this Series
#   cards             how many cards of this Series exist in the deployment (0: not counted)
#   accelerator       false for a Series that has no GPUs (Jobs on it ask for 0 GPUs)
# [profiles.<name>]
#   series            the Series this Profile runs on
#   gpus_per_member   the default shape: GPUs per member when the JobSpec leaves it out
#   fleet             the Fleet Jobs with this Profile are placed onto
#   env               environment variables this shape needs
# [quota.<fleet>]     optional: per Series, the most GPUs Jobs may hold at once in that Fleet,
#   h200 = 4          e.g. a fifth h200 GPU waits ("waiting: quota h200 4/4 in use")

[series.h200]
card_memory_gib = 141
scheduling_pin = "h200"
cards = 0
accelerator = true

[series.h100]
card_memory_gib = 80
scheduling_pin = "h100"
cards = 0
accelerator = true

[series.cpu]
card_memory_gib = 0
scheduling_pin = "cpu"
cards = 0
accelerator = false

[profiles.h200]
series = "h200"
fleet = "default"

[profiles.h200-2g]
series = "h200"
gpus_per_member = 2
fleet = "default"

[profiles.h100]
series = "h100"
fleet = "default"

[profiles.cpu]
series = "cpu"
fleet = "default"
"""


class ConfigError(ValueError):
    """``coordinator.toml`` is missing or wrong; ``str()`` names the file, the key and the fix."""


@attrs.frozen
class Series:
    name: str
    card_memory_gib: int
    scheduling_pin: str
    cards: int
    accelerator: bool


@attrs.frozen
class Profile:
    name: str
    series: str
    fleet: str
    gpus_per_member: int | None = None
    env: Mapping[str, str] = attrs.field(factory=dict)


@attrs.frozen
class CoordinatorConfig:
    series: Mapping[str, Series]
    profiles: Mapping[str, Profile]
    # (fleet, series) -> most GPUs of that Series Jobs may hold at once in that Fleet.
    quotas: Mapping[tuple[str, str], int] = attrs.field(factory=dict)


def _take(table: Mapping[str, Any], key: str, kind: type, where: str, path: Path) -> Any:
    if key not in table:
        raise ConfigError(f"{path}: [{where}] has no '{key}'. Add `{key} = ...` to that table.")
    value = table[key]
    if type(value) is not kind:
        raise ConfigError(
            f"{path}: [{where}] {key} = {value!r} is a {type(value).__name__}, "
            f"but it must be a {kind.__name__}. Fix the value."
        )
    return value


def _check_keys(table: Mapping[str, Any], allowed: set[str], where: str, path: Path) -> None:
    extra = sorted(set(table) - allowed)
    if extra:
        raise ConfigError(
            f"{path}: [{where}] has unknown key(s) {', '.join(extra)}. "
            f"Allowed keys are {', '.join(sorted(allowed))}."
        )


def parse_config(text: str, path: Path) -> CoordinatorConfig:
    """Parse ``coordinator.toml`` text; ``path`` only names the file in errors."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML ({exc}). Fix the syntax.") from None
    _check_keys(raw, {"series", "profiles", "quota"}, "<top level>", path)
    series: dict[str, Series] = {}
    for name, table in raw.get("series", {}).items():
        where = f"series.{name}"
        _check_keys(
            table, {"card_memory_gib", "scheduling_pin", "cards", "accelerator"}, where, path
        )
        series[name] = Series(
            name=name,
            card_memory_gib=_take(table, "card_memory_gib", int, where, path),
            scheduling_pin=_take(table, "scheduling_pin", str, where, path),
            cards=_take(table, "cards", int, where, path),
            accelerator=_take(table, "accelerator", bool, where, path),
        )
    profiles: dict[str, Profile] = {}
    for name, table in raw.get("profiles", {}).items():
        where = f"profiles.{name}"
        _check_keys(table, {"series", "fleet", "gpus_per_member", "env"}, where, path)
        series_name = _take(table, "series", str, where, path)
        if series_name not in series:
            raise ConfigError(
                f"{path}: [{where}] series = {series_name!r} names no Series. "
                f"Add [series.{series_name}] or use one of: {', '.join(sorted(series))}."
            )
        gpm = table.get("gpus_per_member")
        if gpm is not None and (type(gpm) is not int or gpm < 0):
            raise ConfigError(
                f"{path}: [{where}] gpus_per_member = {gpm!r} must be a whole number >= 0."
            )
        env = table.get("env", {})
        if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
            raise ConfigError(f"{path}: [{where}] env must be a table of strings.")
        profiles[name] = Profile(
            name=name,
            series=series_name,
            fleet=table.get("fleet", "default"),
            gpus_per_member=gpm,
            env=dict(env),
        )
    return CoordinatorConfig(
        series=series, profiles=profiles, quotas=_quotas(raw.get("quota", {}), series, path)
    )


def _quotas(
    raw: Mapping[str, Any], series: Mapping[str, Series], path: Path
) -> dict[tuple[str, str], int]:
    """``[quota.<fleet>]`` tables: ``<series> = <GPUs>``, a whole number of at least 1."""
    quotas: dict[tuple[str, str], int] = {}
    for fleet, table in raw.items():
        where = f"quota.{fleet}"
        if not isinstance(table, dict):
            raise ConfigError(
                f"{path}: quota.{fleet} must be a table of `<series> = <GPUs>` lines under "
                f"[quota.{fleet}]."
            )
        for name, limit in table.items():
            if name not in series:
                raise ConfigError(
                    f"{path}: [{where}] {name} names no Series. "
                    f"Use one of: {', '.join(sorted(series))}."
                )
            if type(limit) is not int or limit < 1:
                raise ConfigError(
                    f"{path}: [{where}] {name} = {limit!r} must be a whole number of GPUs >= 1. "
                    "Remove the line for no quota."
                )
            quotas[(fleet, name)] = limit
    return quotas


def load_config(state_dir: Path) -> CoordinatorConfig:
    """Read ``<state_dir>/coordinator.toml``."""
    path = state_dir / CONFIG_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"{path} does not exist. Run `tuneplane-coordinator init --state-dir {state_dir}`."
        ) from None
    return parse_config(text, path)
