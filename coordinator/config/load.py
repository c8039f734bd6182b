"""Reading ``coordinator.toml``: the whole file (:func:`load_config`, :func:`parse_config`), or
only its ``[store]`` setting (:func:`store_setting`).

Rules:
- The file is written once by ``tuneplane-coordinator init`` and edited by the people who run the
  coordinator; a typo is a :class:`ConfigError` naming the file, the key and the fix.
- A key that is still accepted but no longer does anything becomes a warning naming it (never
  silently ignored, never a broken upgrade).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from ..store_location import PostgresUrl
from .defaults import CONFIG_NAME
from .tables import (
    read_addresses,
    read_console,
    read_fleets,
    read_leader,
    read_lifetimes,
    read_limits,
    read_metrics,
    read_quotas,
    read_runtimes,
    read_store,
    take,
)
from .values import ConfigError, CoordinatorConfig, Profile, Series, check_keys

# Keys a Series once required that placement never read; a config that still has them loads,
# and each one becomes a warning naming it (never silently ignored, never a broken upgrade).
_RETIRED_SERIES_KEYS = {
    "card_memory_gib": "Placement matches GPUs by the Series name their Node reports, not by "
    "their memory.",
    "scheduling_pin": "A Node's GPUs are matched to a Series by its name, which is the label "
    "they carry.",
}


def parse_config(text: str, path: Path) -> CoordinatorConfig:
    """Parse ``coordinator.toml`` text; ``path`` only names the file in errors."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML ({exc}). Fix the syntax.") from None
    check_keys(
        raw,
        {
            "series",
            "profiles",
            "quota",
            "credentials",
            "limits",
            "runtimes",
            "fleet",
            "metrics",
            "addresses",
            "store",
            "leader",
            "console",
        },
        "<top level>",
        path,
    )
    series: dict[str, Series] = {}
    warnings: list[str] = []
    for name, table in raw.get("series", {}).items():
        where = f"series.{name}"
        check_keys(table, {*_RETIRED_SERIES_KEYS, "cards", "accelerator"}, where, path)
        warnings += [
            f"{path}: [{where}] {key} is no longer used and is ignored. {why} "
            "Delete the line to silence this warning."
            for key, why in _RETIRED_SERIES_KEYS.items()
            if key in table
        ]
        series[name] = Series(
            name=name,
            cards=take(table, "cards", int, where, path),
            accelerator=take(table, "accelerator", bool, where, path),
        )
    profiles: dict[str, Profile] = {}
    for name, table in raw.get("profiles", {}).items():
        where = f"profiles.{name}"
        check_keys(table, {"series", "fleet", "gpus_per_member", "env"}, where, path)
        series_name = take(table, "series", str, where, path)
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
    node_lifetime, user_lifetime = read_lifetimes(raw.get("credentials", {}), path)
    return CoordinatorConfig(
        series=series,
        profiles=profiles,
        quotas=read_quotas(raw.get("quota", {}), series, path),
        node_credential_lifetime_s=node_lifetime,
        user_token_lifetime_s=user_lifetime,
        limits=read_limits(raw.get("limits", {}), path),
        runtimes=read_runtimes(raw.get("runtimes", {}), path),
        fleets=read_fleets(raw.get("fleet", {}), path),
        metrics=read_metrics(raw, path),
        addresses=read_addresses(raw.get("addresses", {}), path),
        store_url=read_store(raw.get("store", {}), path),
        leader=read_leader(raw.get("leader", {}), path),
        console=read_console(raw, path),
        warnings=tuple(warnings),
    )


def store_setting(state_dir: Path) -> PostgresUrl | None:
    """Only ``[store] url`` of ``<state_dir>/coordinator.toml`` (None: SQLite), for commands that
    need nothing else of the file; a missing file is SQLite, as before [store] existed."""
    path = state_dir / CONFIG_NAME
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML ({exc}). Fix the syntax.") from None
    return read_store(raw.get("store", {}), path)


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
