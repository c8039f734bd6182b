"""What ``coordinator.toml`` says, as frozen values: Series, Profiles, limits, per-Fleet and
per-runtime settings, addresses and the store, and :class:`ConfigError`.

Rules:
- A Profile is a preset over exactly one Series; it never invents hardware the Series lacks.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from tuneplane.agent.metrics_listener import MetricsListener

from ..auth import (
    DEFAULT_NODE_CREDENTIAL_LIFETIME_S,
    DEFAULT_USER_TOKEN_LIFETIME_S,
)
from ..job_changes import DEFAULT_FALLBACK_S, DEFAULT_MAX_WATCHES
from ..leadership import LeaseSettings
from ..store_location import PostgresUrl

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


def check_keys(table: Mapping[str, Any], allowed: set[str], where: str, path: Path) -> None:
    extra = sorted(set(table) - allowed)
    if extra:
        raise ConfigError(
            f"{path}: [{where}] has unknown key(s) {', '.join(extra)}. "
            f"Allowed keys are {', '.join(sorted(allowed))}."
        )


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
    """``[limits]``: the largest message each listener reads, how often one address may call
    ``Enroll``, how many Connects are worked on at once in a reconnect storm
    (coordinator/hello_gate.py), and how many WatchJob streams are served at once. Every size is
    checked before the message is decoded."""

    api_message_bytes: int = 16 * 1024 * 1024
    control_message_bytes: int = 4 * 1024 * 1024
    telemetry_message_bytes: int = 3 * 1024 * 1024
    enroll_message_bytes: int = 64 * 1024
    enroll_burst: int = 20
    enroll_per_second: float = 2.0
    connects_at_once: int = 256
    connect_wait_s: float = 5.0
    connect_queue_s: float = 60.0
    # WatchJob (coordinator/job_changes.py, api/job_watch.py): streams at once, and the seconds
    # a watch waits for a change notice before it reads the Job anyway.
    job_watches: int = DEFAULT_MAX_WATCHES
    job_watch_fallback_s: float = DEFAULT_FALLBACK_S


@attrs.frozen
class RuntimeSettings:
    """``[runtimes."<runtime id>"]``: the coordinator's policy for Jobs on one runtime."""

    runtime_id: str
    allow_loader_env: bool = False


#: How long Preview waits for a registry to answer a tag or digest, unless its entry says.
DEFAULT_REGISTRY_TIMEOUT_S = 10.0


@attrs.frozen
class RegistrySettings:
    """``[fleet.<name>.registries."<host[:port]>"]``: how the coordinator reaches one registry
    when it resolves an image at Preview. The password stays in ``password_file``, read at each
    resolution (so a rotated one needs no restart), and is never printed or logged."""

    registry: str  # host[:port], as image references write it
    ca_file: Path | None = None  # None: the system's CA bundle
    username: str | None = None
    password_file: Path | None = None
    timeout_s: float = DEFAULT_REGISTRY_TIMEOUT_S


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
    # The registries whose images Jobs on this Fleet may run, by ``host[:port]``; an image from
    # any other registry is refused at Preview.
    registries: Mapping[str, RegistrySettings] = attrs.field(factory=dict)


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


#: How long a console sign-in lasts unless ``[console] session_lifetime`` says otherwise.
DEFAULT_CONSOLE_SESSION_S = 12 * 3600
#: How many live streams (server-sent events) the console serves at once unless ``[console]
#: max_streams`` says otherwise, and the most that setting may allow.
DEFAULT_CONSOLE_STREAMS = 200
MAX_CONSOLE_STREAMS = 10_000


@attrs.frozen
class ConsoleSettings:
    """``[console]``: where the web console listens (``host``, ``port``; port 0: a free one),
    how long a sign-in lasts and how many live streams it serves at once. The table being there
    turns the console on."""

    host: str
    port: int
    session_lifetime_s: int = DEFAULT_CONSOLE_SESSION_S
    max_streams: int = DEFAULT_CONSOLE_STREAMS


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
    # [leader]: the lease's timings when coordinators share a PostgreSQL store.
    leader: LeaseSettings = attrs.field(factory=LeaseSettings)
    # [console]: the web console's listener; None: off (the default).
    console: ConsoleSettings | None = None
    # Sentences about keys that are still accepted but no longer do anything; `serve` logs them.
    warnings: tuple[str, ...] = ()

    @property
    def loader_env_runtimes(self) -> frozenset[str]:
        """The runtime ids whose JobSpecs may set loader variables (``allow_loader_env``)."""
        return frozenset(r.runtime_id for r in self.runtimes.values() if r.allow_loader_env)
