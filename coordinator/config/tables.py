"""Readers of ``coordinator.toml``'s optional tables (``[quota.*]``, ``[credentials]``,
``[limits]``, ``[runtimes.*]``, ``[fleet.*]`` with their ``registries``, ``[metrics]``,
``[addresses]``, ``[store]``, ``[console]``) and the key and type checks every reader shares.

Rules:
- A typo is a :class:`~tuneplane.coordinator.config.values.ConfigError` naming the file, the key
  and the fix; an unknown key is never ignored.
"""

from __future__ import annotations

import ipaddress
import posixpath
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from tuneplane.agent.host_port import split_host_port
from tuneplane.agent.metrics_listener import (
    DEFAULT_COORDINATOR_PORT,
    MetricsConfigError,
    MetricsListener,
    metrics_listener,
)
from tuneplane.proto.contract.control_protocol import QUEUED_CAP_S

from ..auth import (
    DEFAULT_NODE_CREDENTIAL_LIFETIME_S,
    DEFAULT_USER_TOKEN_LIFETIME_S,
)
from ..leadership import LeaseSettings, LeaseSettingsError
from ..store_location import PostgresUrl, StoreUrlError, parse_store_url
from .registries import read_registries
from .values import (
    DEFAULT_CONSOLE_SESSION_S,
    DEFAULT_CONSOLE_STREAMS,
    MAX_CONSOLE_STREAMS,
    AddressSettings,
    ConfigError,
    ConsoleSettings,
    FleetSettings,
    Limits,
    RuntimeSettings,
    Series,
    check_keys,
    parse_duration,
)


def take(table: Mapping[str, Any], key: str, kind: type, where: str, path: Path) -> Any:
    if key not in table:
        raise ConfigError(f"{path}: [{where}] has no '{key}'. Add `{key} = ...` to that table.")
    value = table[key]
    if type(value) is not kind:
        raise ConfigError(
            f"{path}: [{where}] {key} = {value!r} is a {type(value).__name__}, "
            f"but it must be a {kind.__name__}. Fix the value."
        )
    return value


def read_store(table: Any, path: Path) -> PostgresUrl | None:
    """``[store]``: ``url``, a PostgreSQL URL; None (SQLite) without it."""
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: store must be a table. Write it as [store].")
    check_keys(table, {"url"}, "store", path)
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


def read_addresses(table: Any, path: Path) -> AddressSettings:
    """``[addresses]``: strings only; serve checks what they say
    (coordinator/server/advertise.py)."""
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [addresses] must be a table. Write it as [addresses].")
    keys = {"host", "api", "control", "telemetry"}
    check_keys(table, keys, "addresses", path)
    for key, value in table.items():
        if type(value) is not str or not value.strip() or value != value.strip():
            raise ConfigError(
                f"{path}: [addresses] {key} = {value!r} must be a non-empty string without "
                'surrounding spaces, e.g. host = "coordinator.example.org". Fix the value.'
            )
    return AddressSettings(**table)


def read_leader(raw: Any, path: Path) -> LeaseSettings:
    """``[leader]``: ``ttl_s``, ``renew_s`` and ``poll_s``, seconds (the lease of coordinators
    sharing a PostgreSQL store; defaults in :class:`LeaseSettings`)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: leader must be a table ([leader] with ttl_s = 5).")
    check_keys(raw, {"ttl_s", "renew_s", "poll_s"}, "leader", path)
    for key, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: [leader] {key} = {value!r} must be a number of seconds.")
    try:
        return LeaseSettings(**{k: float(v) for k, v in raw.items()})
    except LeaseSettingsError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def read_metrics(raw: Mapping[str, Any], path: Path) -> MetricsListener | None:
    """``[metrics]``: ``port`` (default 7446) and ``host`` (default 127.0.0.1); off without it."""
    if "metrics" not in raw:
        return None
    try:
        return metrics_listener(raw["metrics"], DEFAULT_COORDINATOR_PORT)
    except MetricsConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def read_console(raw: Mapping[str, Any], path: Path) -> ConsoleSettings | None:
    """``[console]``: ``listen`` (``HOST:PORT``, an IP address; port 0: a free one) and
    ``session_lifetime`` (a duration, default 12h) and ``max_streams`` (live streams at once,
    1 to :data:`MAX_CONSOLE_STREAMS`, default :data:`DEFAULT_CONSOLE_STREAMS`); off without the
    table."""
    if "console" not in raw:
        return None
    table = raw["console"]
    if not isinstance(table, dict):
        raise ConfigError(
            f"{path}: console must be a table. Write it as [console] with "
            'listen = "127.0.0.1:8443".'
        )
    check_keys(table, {"listen", "session_lifetime", "max_streams"}, "console", path)
    listen = table.get("listen")
    found = split_host_port(listen, allow_zero=True) if isinstance(listen, str) else None
    if found is not None:
        try:
            ipaddress.ip_address(found[0])
        except ValueError:
            found = None
    if found is None:
        raise ConfigError(
            f"{path}: [console] listen = {listen!r} is not an IP address and port. Write where "
            'the console listens in quotes, e.g. listen = "127.0.0.1:8443" (this machine only) '
            'or listen = "0.0.0.0:8443" (every interface); remove [console] to turn it off.'
        )
    lifetime = table.get("session_lifetime", DEFAULT_CONSOLE_SESSION_S)
    if "session_lifetime" in table:
        value = table["session_lifetime"]
        lifetime = parse_duration(value) if isinstance(value, str) else None
        if lifetime is None:
            raise ConfigError(
                f"{path}: [console] session_lifetime = {value!r} is not a duration. Write how "
                'long a sign-in lasts as a whole number and a unit in quotes: "30m", "12h" or "7d".'
            )
    streams = table.get("max_streams", DEFAULT_CONSOLE_STREAMS)
    # bool is an int in Python; `max_streams = true` is a mistake, not 1.
    if isinstance(streams, bool) or not isinstance(streams, int):
        streams = None
    if streams is None or not 1 <= streams <= MAX_CONSOLE_STREAMS:
        raise ConfigError(
            f"{path}: [console] max_streams = {table['max_streams']!r} is not a whole number "
            f"from 1 to {MAX_CONSOLE_STREAMS}. Write how many live streams (pages followed live) "
            f"the console serves at once, without quotes; the default is "
            f"{DEFAULT_CONSOLE_STREAMS}."
        )
    return ConsoleSettings(found[0], found[1], lifetime, streams)


def read_fleets(raw: Any, path: Path) -> dict[str, FleetSettings]:
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
        check_keys(table, {"max_disconnect", "shared_output_root", "registries"}, where, path)
        shared = _shared_output_root(table.get("shared_output_root", ""), where, path)
        registries = read_registries(table.get("registries", {}), where, path)
        value = table.get("max_disconnect")
        if value is None:
            found[name] = FleetSettings(name, shared_output_root=shared, registries=registries)
            continue
        seconds = parse_duration(value) if isinstance(value, str) else None
        if seconds is None:
            raise ConfigError(
                f"{path}: [{where}] max_disconnect = {value!r} is not a duration. Write a whole "
                'number and a unit in quotes ("90s", "30m", "2h", "1d"), or remove the line to '
                "never declare its Nodes lost automatically."
            )
        found[name] = FleetSettings(name, seconds, value.strip(), shared, registries)
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


def read_runtimes(raw: Any, path: Path) -> dict[str, RuntimeSettings]:
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
        check_keys(table, {"allow_loader_env"}, where, path)
        allow = table.get("allow_loader_env", False)
        if type(allow) is not bool:
            raise ConfigError(
                f"{path}: [{where}] allow_loader_env = {allow!r} must be true or false."
            )
        found[runtime_id] = RuntimeSettings(runtime_id, allow)
    return found


def read_lifetimes(table: Any, path: Path) -> tuple[int, int]:
    """``[credentials]``: ``node_lifetime`` and ``user_token_lifetime`` as durations."""
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: credentials must be a table ([credentials]).")
    check_keys(table, {"node_lifetime", "user_token_lifetime"}, "credentials", path)
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


#: [limits] keys that are counts: the lowest and highest allowed, and what the lowest means.
WHOLE_LIMITS = {
    "enroll_burst": (0, 1_000_000, " (no limit)"),
    "connects_at_once": (1, 100_000, ""),
    "job_watches": (1, 100_000, ""),
}
#: The longest a WatchJob stream waits for a change notice before it reads its Job anyway.
MAX_WATCH_FALLBACK_S = 3600.0


def read_limits(table: Any, path: Path) -> Limits:
    """``[limits]``: sizes are whole numbers of bytes >= 1024; the Enroll rate is >= 0."""
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: limits must be a table ([limits]).")
    fields = {f.name: f for f in attrs.fields(Limits)}
    check_keys(table, set(fields), "limits", path)
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key == "enroll_per_second":
            if type(value) not in (int, float) or not 0 <= value <= 1e6:
                raise ConfigError(
                    f"{path}: [limits] enroll_per_second = {value!r} must be a number from 0 "
                    "to 1000000."
                )
            values[key] = float(value)
        elif key == "connect_wait_s":
            if type(value) not in (int, float) or not 0 < value <= 9:
                raise ConfigError(
                    f"{path}: [limits] connect_wait_s = {value!r} must be a number of seconds "
                    "above 0 and at most 9: a Node gives up on its Welcome after 10 s."
                )
            values[key] = float(value)
        elif key == "connect_queue_s":
            if type(value) not in (int, float) or not 0 <= value <= QUEUED_CAP_S / 2:
                raise ConfigError(
                    f"{path}: [limits] connect_queue_s = {value!r} must be a number of seconds "
                    f"from 0 (no line: every Connect waits connect_wait_s) to "
                    f"{QUEUED_CAP_S / 2:g}: a Node in line waits for its Welcome at most "
                    f"{QUEUED_CAP_S:g} s."
                )
            values[key] = float(value)
        elif key == "job_watch_fallback_s":
            if type(value) not in (int, float) or not 0.1 <= value <= MAX_WATCH_FALLBACK_S:
                raise ConfigError(
                    f"{path}: [limits] job_watch_fallback_s = {value!r} must be a number of "
                    f"seconds from 0.1 to {MAX_WATCH_FALLBACK_S:g}: how long a WatchJob stream "
                    "waits for a change notice before it reads its Job anyway."
                )
            values[key] = float(value)
        elif key in WHOLE_LIMITS:
            low, high, note = WHOLE_LIMITS[key]
            if type(value) is not int or not low <= value <= high:
                raise ConfigError(
                    f"{path}: [limits] {key} = {value!r} must be a whole number from {low}"
                    f"{note} to {high}."
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


def read_quotas(
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
