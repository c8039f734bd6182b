"""``coordinator.toml``: the Series and Profiles this coordinator knows, read with tomllib.

Rules:
- The file is written once by ``tuneplane-coordinator init`` and edited by the people who run the
  coordinator; a typo is a :class:`ConfigError` naming the file, the key and the fix.
- A Profile is a preset over exactly one Series; it never invents hardware the Series lacks.
"""

from __future__ import annotations

import posixpath
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from tuneplane.agent.metrics_listener import (
    DEFAULT_COORDINATOR_PORT,
    MetricsConfigError,
    MetricsListener,
    metrics_listener,
)

from .auth import (
    DEFAULT_NODE_CREDENTIAL_LIFETIME_S,
    DEFAULT_USER_TOKEN_LIFETIME_S,
)
from .store.location import PostgresUrl, StoreUrlError, parse_store_url

CONFIG_NAME = "coordinator.toml"

DEFAULT_CONFIG = """\
# TunePlane coordinator configuration: the Series (classes of accelerator) and the Profiles
# (named presets over a Series) that `tp submit --profile` takes.
#
# [series.<name>]
#   cards             how many cards of this Series exist in the deployment (0: not counted)
#   accelerator       false for a Series that has no GPUs (Jobs on it ask for 0 GPUs)
# [profiles.<name>]
#   series            the Series this Profile runs on
#   gpus_per_member   the default shape: GPUs per member when the JobSpec leaves it out
#   fleet             the Fleet Jobs with this Profile are placed onto
#   env               environment variables this shape needs
# [quota.<fleet>]     optional: per Series, the most GPUs Jobs may hold at once in that Fleet,
#   h200 = 4          e.g. a fifth h200 GPU waits ("waiting: quota h200 4/4 in use")
# [credentials]       optional: how long credentials live (a whole number and s, m, h or d)
#   node_lifetime = "30d"        a Node's control credential; renewed in its second half
#   user_token_lifetime = "90d"  the default of `user create --expires-in`
# [limits]            optional: bounds on what callers may send (docs/security.md)
#   api_message_bytes = 16777216        one message on the API listener (a Preview carries
#                                       up to 8 MiB of experiment files, base64-encoded)
#   control_message_bytes = 4194304     one message on the control listener
#   telemetry_message_bytes = 3145728   one Ship batch on the telemetry listener
#   enroll_message_bytes = 65536        one Enroll (unauthenticated)
#   enroll_burst = 20                   Enroll calls one address may make at once,
#   enroll_per_second = 2.0             and then per second (enroll_burst = 0: no limit)
# [fleet.<name>]     optional: per Fleet
#   max_disconnect = "2h"     declare a Node lost when it holds members and stays disconnected
#                             this long (off unless set; docs/operator.md, "A Node that never
#                             comes back", says what it risks)
#   shared_output_root = "/mnt/tp-out"  a directory every Node of the Fleet mounts at this
#                             path and uses as its output root (node.toml out_root): a run
#                             whose outputs lie under it can be an --init-from source
#                             (docs/researcher.md, "Starting from another run")
# [runtimes."<runtime id>"]  optional: what Jobs on one runtime may do
#   allow_loader_env = true   a JobSpec's env may set LD_*, PYTHONPATH and their kin on this
#                             runtime (refused at Preview otherwise); the Node decides again
#                             with allow_loader_env in its node.toml
# [metrics]           optional: serve Prometheus metrics over plain HTTP (off without the table;
#   port = 7446       docs/operator.md, "Metrics", lists them)
#   host = "127.0.0.1"        the address to listen on (default: this machine only)
# [addresses]         optional: the addresses serve hands out (endpoints.json, tp-context.json,
#                     the telemetry address in every Commit); docs/operator.md, "Addresses"
#   host = "coordinator.example.org"   every listener at this name or address (serve
#                     --advertise wins); needed when serve listens on 0.0.0.0 or ::
#   control = "lb.example.org:7444"    one listener at a whole HOST:PORT (a NAT or a load
#                     balancer in front); also api = ... and telemetry = ...
# [store]             optional: keep the coordinator's state in a PostgreSQL database instead of
#                     the SQLite files in this directory (`init --store` writes it; `serve
#                     --store` overrides it for one run; docs/operator.md, "PostgreSQL store")
#   url = "postgresql://tuneplane@db.example.org:5432/tuneplane"
#                     leave the password out: the driver reads PGPASSWORD and ~/.pgpass, as
#                     psql does, and the coordinator never prints or logs it

[series.h200]
cards = 0
accelerator = true

[series.h100]
cards = 0
accelerator = true

[series.cpu]
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


_DURATION = re.compile(r"^(\d+)([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> int | None:
    """``30s``, ``15m``, ``1h``, ``7d`` -> seconds (at least 1); ``None`` when it is not one."""
    match = _DURATION.match(text.strip())
    if not match or int(match.group(1)) == 0:
        return None
    return int(match.group(1)) * _UNITS[match.group(2)]


class ConfigError(ValueError):
    """``coordinator.toml`` is missing or wrong; ``str()`` names the file, the key and the fix."""


@attrs.frozen
class Series:
    name: str
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
class Limits:
    """``[limits]``: the largest message each listener reads, and how often one address may
    call ``Enroll``. Every size is checked before the message is decoded."""

    api_message_bytes: int = 16 * 1024 * 1024
    control_message_bytes: int = 4 * 1024 * 1024
    telemetry_message_bytes: int = 3 * 1024 * 1024
    enroll_message_bytes: int = 64 * 1024
    enroll_burst: int = 20
    enroll_per_second: float = 2.0


@attrs.frozen
class RuntimeSettings:
    """``[runtimes."<runtime id>"]``: the coordinator's policy for Jobs on one runtime."""

    runtime_id: str
    allow_loader_env: bool = False


@attrs.frozen
class FleetSettings:
    """``[fleet.<name>]``: per-Fleet settings."""

    name: str
    # Declare a Node of this Fleet lost once it has been disconnected this long while holding
    # members (seconds; None: never, the default). ``max_disconnect_text`` is as written.
    max_disconnect_s: int | None = None
    max_disconnect_text: str = ""
    # An absolute directory every Node of the Fleet mounts at this same path as its output
    # root; outputs under it can seed a Derivation (``--init-from``). "": none declared.
    shared_output_root: str = ""


@attrs.frozen
class AddressSettings:
    """``[addresses]``: what serve advertises (``coordinator/server/advertise.py``); "" when
    unset."""

    host: str = ""
    api: str = ""
    control: str = ""
    telemetry: str = ""

    def with_host(self, host: str | None) -> AddressSettings:
        """These settings with ``serve --advertise`` (when given) as ``host``."""
        return self if not host else attrs.evolve(self, host=host)


@attrs.frozen
class CoordinatorConfig:
    series: Mapping[str, Series]
    profiles: Mapping[str, Profile]
    # (fleet, series) -> most GPUs of that Series Jobs may hold at once in that Fleet.
    quotas: Mapping[tuple[str, str], int] = attrs.field(factory=dict)
    node_credential_lifetime_s: int = DEFAULT_NODE_CREDENTIAL_LIFETIME_S
    user_token_lifetime_s: int = DEFAULT_USER_TOKEN_LIFETIME_S
    limits: Limits = attrs.field(factory=Limits)
    runtimes: Mapping[str, RuntimeSettings] = attrs.field(factory=dict)
    fleets: Mapping[str, FleetSettings] = attrs.field(factory=dict)
    # [metrics]: where the Prometheus listener binds; None: off (the default).
    metrics: MetricsListener | None = None
    addresses: AddressSettings = attrs.field(factory=AddressSettings)
    # [store] url: the PostgreSQL database holding the stores; None: SQLite in the state directory.
    store_url: PostgresUrl | None = None
    # Sentences about keys that are still accepted but no longer do anything; `serve` logs them.
    warnings: tuple[str, ...] = ()

    @property
    def loader_env_runtimes(self) -> frozenset[str]:
        """The runtime ids whose JobSpecs may set loader variables (``allow_loader_env``)."""
        return frozenset(r.runtime_id for r in self.runtimes.values() if r.allow_loader_env)


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
    _check_keys(
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
        },
        "<top level>",
        path,
    )
    series: dict[str, Series] = {}
    warnings: list[str] = []
    for name, table in raw.get("series", {}).items():
        where = f"series.{name}"
        _check_keys(table, {*_RETIRED_SERIES_KEYS, "cards", "accelerator"}, where, path)
        warnings += [
            f"{path}: [{where}] {key} is no longer used and is ignored. {why} "
            "Delete the line to silence this warning."
            for key, why in _RETIRED_SERIES_KEYS.items()
            if key in table
        ]
        series[name] = Series(
            name=name,
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
    node_lifetime, user_lifetime = _lifetimes(raw.get("credentials", {}), path)
    return CoordinatorConfig(
        series=series,
        profiles=profiles,
        quotas=_quotas(raw.get("quota", {}), series, path),
        node_credential_lifetime_s=node_lifetime,
        user_token_lifetime_s=user_lifetime,
        limits=_limits(raw.get("limits", {}), path),
        runtimes=_runtimes(raw.get("runtimes", {}), path),
        fleets=_fleets(raw.get("fleet", {}), path),
        metrics=_metrics(raw, path),
        addresses=_addresses(raw.get("addresses", {}), path),
        store_url=_store(raw.get("store", {}), path),
        warnings=tuple(warnings),
    )


def _store(table: Any, path: Path) -> PostgresUrl | None:
    """``[store]``: ``url``, a PostgreSQL URL; None (SQLite) without it."""
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: store must be a table. Write it as [store].")
    _check_keys(table, {"url"}, "store", path)
    if "url" not in table:
        return None
    if type(table["url"]) is not str:
        raise ConfigError(
            f"{path}: [store] url = {table['url']!r} must be a string in quotes, e.g. "
            'url = "postgresql://tuneplane@db.example.org:5432/tuneplane".'
        )
    try:
        return parse_store_url(table["url"], f"{path}: [store] url")
    except StoreUrlError as exc:
        raise ConfigError(str(exc)) from None


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
    return _store(raw.get("store", {}), path)


def store_table(url: PostgresUrl) -> str:
    """The ``[store]`` table ``init --store`` appends to coordinator.toml."""
    return (
        "\n[store]\n"
        "# Written by `tuneplane-coordinator init --store`: the stores live in this PostgreSQL\n"
        "# database. Keep the password out of this file: the driver reads PGPASSWORD and\n"
        "# ~/.pgpass. `serve --store URL` overrides this for one run.\n"
        f"url = {_toml_string(url.dsn())}\n"
    )


def _toml_string(text: str) -> str:
    """``text`` as a TOML basic string (a checked URL: printable ASCII, no control characters)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _addresses(table: Any, path: Path) -> AddressSettings:
    """``[addresses]``: strings only; serve checks what they say
    (coordinator/server/advertise.py)."""
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [addresses] must be a table. Write it as [addresses].")
    keys = {"host", "api", "control", "telemetry"}
    _check_keys(table, keys, "addresses", path)
    for key, value in table.items():
        if type(value) is not str or not value.strip() or value != value.strip():
            raise ConfigError(
                f"{path}: [addresses] {key} = {value!r} must be a non-empty string without "
                'surrounding spaces, e.g. host = "coordinator.example.org". Fix the value.'
            )
    return AddressSettings(**table)


def _metrics(raw: Mapping[str, Any], path: Path) -> MetricsListener | None:
    """``[metrics]``: ``port`` (default 7446) and ``host`` (default 127.0.0.1); off without it."""
    if "metrics" not in raw:
        return None
    try:
        return metrics_listener(raw["metrics"], DEFAULT_COORDINATOR_PORT)
    except MetricsConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def _fleets(raw: Any, path: Path) -> dict[str, FleetSettings]:
    """``[fleet.<name>]`` tables: ``max_disconnect``, a duration in quotes."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: fleet must hold tables, one per Fleet: [fleet.default].")
    found: dict[str, FleetSettings] = {}
    for name, table in raw.items():
        where = f"fleet.{name}"
        if not isinstance(table, dict):
            raise ConfigError(
                f'{path}: {where} must be a table ([{where}] with max_disconnect = "2h").'
            )
        _check_keys(table, {"max_disconnect", "shared_output_root"}, where, path)
        shared = _shared_output_root(table.get("shared_output_root", ""), where, path)
        value = table.get("max_disconnect")
        if value is None:
            found[name] = FleetSettings(name, shared_output_root=shared)
            continue
        seconds = parse_duration(value) if isinstance(value, str) else None
        if seconds is None:
            raise ConfigError(
                f"{path}: [{where}] max_disconnect = {value!r} is not a duration. Write a whole "
                'number and a unit in quotes ("90s", "30m", "2h", "1d"), or remove the line to '
                "never declare its Nodes lost automatically."
            )
        found[name] = FleetSettings(name, seconds, value.strip(), shared)
    return found


def _shared_output_root(value: object, where: str, path: Path) -> str:
    """``shared_output_root``: an absolute, normalised directory path, or "" when not set."""
    if value == "":
        return ""
    if (
        not isinstance(value, str)
        or not value.startswith("/")
        or posixpath.normpath(value) != value.rstrip("/")
        or "\0" in value
    ):
        raise ConfigError(
            f"{path}: [{where}] shared_output_root = {value!r} is not an absolute, normalised "
            'directory path. Write the path every Node of the Fleet mounts, e.g. "/mnt/tp-out", '
            "or remove the line."
        )
    return value.rstrip("/") or "/"


_RUNTIME_ID = re.compile(r"^(host|image):\S+$")


def _runtimes(raw: Any, path: Path) -> dict[str, RuntimeSettings]:
    """``[runtimes."<runtime id>"]`` tables: ``allow_loader_env``, true or false."""
    if not isinstance(raw, dict):
        raise ConfigError(
            f'{path}: runtimes must hold tables, one per runtime: [runtimes."host:python3"].'
        )
    found: dict[str, RuntimeSettings] = {}
    for runtime_id, table in raw.items():
        where = f'runtimes."{runtime_id}"'
        if not _RUNTIME_ID.match(runtime_id):
            raise ConfigError(
                f"{path}: [{where}] does not name a runtime id. Write the id in quotes as Jobs "
                'name it: [runtimes."host:python3"] or '
                '[runtimes."image:<registry>/<name>@sha256:..."].'
            )
        if not isinstance(table, dict):
            raise ConfigError(
                f"{path}: {where} must be a table ([{where}] with allow_loader_env = true or "
                "false)."
            )
        _check_keys(table, {"allow_loader_env"}, where, path)
        allow = table.get("allow_loader_env", False)
        if type(allow) is not bool:
            raise ConfigError(
                f"{path}: [{where}] allow_loader_env = {allow!r} must be true or false."
            )
        found[runtime_id] = RuntimeSettings(runtime_id, allow)
    return found


def _lifetimes(table: Any, path: Path) -> tuple[int, int]:
    """``[credentials]``: ``node_lifetime`` and ``user_token_lifetime`` as durations."""
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: credentials must be a table ([credentials]).")
    _check_keys(table, {"node_lifetime", "user_token_lifetime"}, "credentials", path)
    found = []
    for key, default in (
        ("node_lifetime", DEFAULT_NODE_CREDENTIAL_LIFETIME_S),
        ("user_token_lifetime", DEFAULT_USER_TOKEN_LIFETIME_S),
    ):
        if key not in table:
            found.append(default)
            continue
        value = table[key]
        seconds = parse_duration(value) if isinstance(value, str) else None
        if seconds is None:
            raise ConfigError(
                f"{path}: [credentials] {key} = {value!r} is not a duration. Write a whole "
                'number and a unit in quotes: "30s", "15m", "12h" or "30d".'
            )
        found.append(seconds)
    return found[0], found[1]


def _limits(table: Any, path: Path) -> Limits:
    """``[limits]``: sizes are whole numbers of bytes >= 1024; the Enroll rate is >= 0."""
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: limits must be a table ([limits]).")
    fields = {f.name: f for f in attrs.fields(Limits)}
    _check_keys(table, set(fields), "limits", path)
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key == "enroll_per_second":
            if type(value) not in (int, float) or not 0 <= value <= 1e6:
                raise ConfigError(
                    f"{path}: [limits] enroll_per_second = {value!r} must be a number from 0 "
                    "to 1000000."
                )
            values[key] = float(value)
        elif key == "enroll_burst":
            if type(value) is not int or not 0 <= value <= 1_000_000:
                raise ConfigError(
                    f"{path}: [limits] enroll_burst = {value!r} must be a whole number from 0 "
                    "(no limit) to 1000000."
                )
            values[key] = value
        else:
            if type(value) is not int or not 1024 <= value <= 2**31 - 1:
                raise ConfigError(
                    f"{path}: [limits] {key} = {value!r} must be a whole number of bytes from "
                    "1024 to 2147483647."
                )
            values[key] = value
    return Limits(**values)


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
