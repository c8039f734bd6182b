"""``/etc/tuneplane/node.toml``: the settings a sysadmin writes once per machine.

Rules: the file only supplies defaults for command-line options (a flag always wins), except the
workload policy (``isolation``, ``[accounts]``, ``[runtimes.<name>]``), which only the file sets;
an unknown key or a value of the wrong type is an error naming the file, the key and the fix, so a
typo never silently falls back to a built-in default.
"""

from __future__ import annotations

import ipaddress
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from .config_registries import registries_settings
from .config_tables import DEFAULT_PATH as DEFAULT_PATH
from .config_tables import NodeConfigError as NodeConfigError
from .config_tables import check_table
from .host_port import split_host_port
from .metrics_listener import (
    DEFAULT_NODE_PORT,
    MetricsConfigError,
    MetricsListener,
    metrics_listener,
)
from .sizes import parse_size

DEFAULT_WORK_ROOT = Path("/var/lib/tuneplane-work")
# Where a runtime without its own [runtimes.<name>] table looks for its interpreter, and the
# PATH its workloads get: the distribution's directories, never the agent's own PATH.
DEFAULT_RUNTIME_PATH = "/usr/local/bin:/usr/bin:/bin"
# The pool a root agent uses when node.toml has no [accounts] table (see docs/operator.md).
DEFAULT_POOL_PREFIX = "tuneplane-member-"
DEFAULT_POOL_COUNT = 8

ACCOUNT_MODES = ("pool", "user", "agent")
ISOLATIONS = ("none", "bwrap")

# key in node.toml -> (type, the commands whose option of the same name it sets)
_KEYS: Mapping[str, tuple[type, tuple[str, ...]]] = {
    "state_dir": (str, ("enroll", "run", "status", "doctor", "journal", "images")),
    "out_root": (str, ("run",)),
    "work_root": (str, ("run",)),
    "image_root": (str, ("run", "doctor", "images")),
    "simulate_gpus": (str, ("enroll", "run")),
    "log_level": (str, ("run",)),
    # The workload policy: read by run, status and doctor from the file itself.
    "isolation": (str, ()),
    "accounts": (dict, ()),
    "runtimes": (dict, ()),
    # [telemetry] system_interval_s and max_files set `run --system-interval` and
    # `run --telemetry-max-files` (see default_map).
    "telemetry": (dict, ()),
    # [metrics]: the Prometheus listener of `run` (off without the table); read by run.
    "metrics": (dict, ()),
    # [outputs]: where `run` serves its ended members' outputs to other Nodes; read by run and
    # doctor (outputs_settings).
    "outputs": (dict, ()),
    # [images]: the runtime image cache's size limit (max_size); read by run, images and doctor
    # (images_settings).
    "images": (dict, ()),
    # [registries."<host[:port]>"]: how `run` reaches the registries runtime images come from
    # (TLS CA, credentials); read by run (registries_settings).
    "registries": (dict, ()),
}
_JOURNAL_COMMANDS = ("members", "show", "events", "reservations", "export")
# Command groups whose subcommands each take the group's settings.
_GROUPS: Mapping[str, tuple[str, ...]] = {
    "journal": _JOURNAL_COMMANDS,
    "images": ("ls", "rm", "prune"),
}
_ACCOUNT_KEYS: Mapping[str, type] = {"mode": str, "pool": list, "prefix": str, "count": int}
_RUNTIME_KEYS: Mapping[str, type] = {"path": str, "interpreter": str, "allow_loader_env": bool}
_TELEMETRY_KEYS: Mapping[str, type] = {"system_interval_s": float, "max_files": int}
_OUTPUTS_KEYS: Mapping[str, type] = {"listen": str, "advertise": str}
#: Where a Node serves its ended members' outputs unless [outputs] listen says otherwise.
DEFAULT_OUTPUTS_LISTEN = "0.0.0.0:7463"
_HOST_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")
# The most telemetry files one member's collector may be told to follow at once.
MAX_TELEMETRY_FILES = 100_000
# The most seconds between system samples (an hour), as `run --system-interval` accepts.
MAX_SYSTEM_INTERVAL_S = 3600.0
_ACCOUNT_NAME = re.compile(r"^[a-z_][a-z0-9_.-]{0,31}$")


@attrs.frozen
class Runtime:
    """What ``host:<name>`` means on this Node: the interpreter and the workload's PATH."""

    name: str
    path: str
    interpreter: str
    allow_loader_env: bool = False
    # False when node.toml has no [runtimes.<name>] table and the documented default applies.
    configured: bool = True


@attrs.frozen
class WorkloadPolicy:
    """Who members run as and how they are confined (node.toml's workload settings).

    ``mode``: ``pool`` (one account of ``pool`` per member at a time), ``user`` (the local
    account named like the submitting TunePlane user) or ``agent`` (the agent's own user; only
    allowed when the agent is not root). ``isolation``: ``none`` or ``bwrap``.
    """

    mode: str
    pool: tuple[str, ...] = ()
    isolation: str = "none"
    runtimes: Mapping[str, Runtime] = attrs.field(factory=dict)
    # True when node.toml said nothing about accounts and the safe default was chosen.
    defaulted: bool = False

    def runtime(self, name: str) -> Runtime:
        """The runtime ``host:<name>``: node.toml's definition or the documented default."""
        found = self.runtimes.get(name)
        if found is not None:
            return found
        return Runtime(
            name=name,
            path=DEFAULT_RUNTIME_PATH,
            interpreter=_which(name, DEFAULT_RUNTIME_PATH) or name,
            configured=False,
        )

    def problem_running_as(self, euid: int) -> str | None:
        """A sentence when this policy must not be used by an agent with effective uid ``euid``."""
        if self.mode == "agent" and euid == 0:
            return (
                '[accounts] mode = "agent" would run every workload as root, the agent\'s own '
                'user; use mode = "pool" with dedicated accounts (see docs/operator.md) or run '
                "the agent as an unprivileged user."
            )
        if self.mode != "agent" and euid != 0:
            return (
                f'[accounts] mode = "{self.mode}" needs the agent to run as root to switch to the '
                'members\' accounts; run it as root or set mode = "agent".'
            )
        return None


def _which(name: str, path: str) -> str | None:
    if "/" in name:
        return name
    for folder in path.split(":"):
        candidate = os.path.join(folder, name)
        if folder and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def default_policy(euid: int) -> WorkloadPolicy:
    """The policy without an [accounts] table: never the agent's user when that is root.

    Root gets the pool ``tuneplane-member-0`` .. ``tuneplane-member-7`` (created by the
    operator; a missing account refuses the Prepare with a sentence saying how to create it);
    a non-root agent can only run members as itself.
    """
    if euid == 0:
        pool = tuple(f"{DEFAULT_POOL_PREFIX}{i}" for i in range(DEFAULT_POOL_COUNT))
        return WorkloadPolicy(mode="pool", pool=pool, defaulted=True)
    return WorkloadPolicy(mode="agent", defaulted=True)


def _accounts(path: Path, raw: Mapping[str, Any]) -> tuple[str, tuple[str, ...]]:
    check_table(path, "accounts", raw, _ACCOUNT_KEYS)
    mode = raw.get("mode")
    if mode not in ACCOUNT_MODES:
        raise NodeConfigError(
            f"{path}: 'accounts.mode' is {mode!r}; set it to one of "
            f"{', '.join(repr(m) for m in ACCOUNT_MODES)}."
        )
    pool: tuple[str, ...] = ()
    if "pool" in raw and ("prefix" in raw or "count" in raw):
        raise NodeConfigError(
            f"{path}: [accounts] gives both 'pool' and 'prefix'/'count'; keep one way of naming "
            "the pool."
        )
    if "pool" in raw:
        names = raw["pool"]
        if not all(isinstance(n, str) for n in names):
            raise NodeConfigError(f"{path}: 'accounts.pool' must be a list of account names.")
        pool = tuple(names)
    elif "prefix" in raw or "count" in raw:
        if "prefix" not in raw or "count" not in raw:
            raise NodeConfigError(
                f"{path}: [accounts] needs both 'prefix' and 'count' to name a pool "
                '(e.g. prefix = "tp-member-", count = 8).'
            )
        if not 1 <= raw["count"] <= 1024:
            raise NodeConfigError(
                f"{path}: 'accounts.count' is {raw['count']}; give 1 to 1024 accounts."
            )
        pool = tuple(f"{raw['prefix']}{i}" for i in range(raw["count"]))
    for name in pool:
        if not _ACCOUNT_NAME.match(name) or name == "root":
            raise NodeConfigError(
                f"{path}: the pool account name {name!r} is not a valid unprivileged account "
                "name; use lower-case letters, digits, '_', '-' or '.', and never root."
            )
    if len(set(pool)) != len(pool):
        raise NodeConfigError(f"{path}: 'accounts.pool' names an account more than once.")
    if mode == "pool" and not pool:
        raise NodeConfigError(
            f'{path}: [accounts] mode = "pool" needs the accounts: set pool = ["tp-member-0", '
            '...] or prefix = "tp-member-" and count = 8.'
        )
    if mode != "pool" and pool:
        raise NodeConfigError(
            f'{path}: [accounts] names a pool but mode is "{mode}"; remove the pool or set '
            'mode = "pool".'
        )
    return mode, pool


def _runtimes(path: Path, raw: Mapping[str, Any]) -> dict[str, Runtime]:
    runtimes: dict[str, Runtime] = {}
    for name, table in raw.items():
        where = f"runtimes.{name}"
        if not isinstance(table, dict):
            raise NodeConfigError(
                f"{path}: '{where}' must be a table ([{where}] with path and interpreter)."
            )
        check_table(path, where, table, _RUNTIME_KEYS)
        for key in ("path", "interpreter"):
            if key not in table:
                raise NodeConfigError(f"{path}: [{where}] has no '{key}'; add it.")
        folders = table["path"].split(":")
        if not all(f.startswith("/") for f in folders):
            raise NodeConfigError(
                f"{path}: '{where}.path' = {table['path']!r} holds a folder that is not "
                'absolute; give absolute folders separated by ":".'
            )
        if not table["interpreter"].startswith("/"):
            raise NodeConfigError(
                f"{path}: '{where}.interpreter' = {table['interpreter']!r} is not an absolute "
                'path; give the full path, e.g. "/usr/bin/python3".'
            )
        runtimes[name] = Runtime(
            name=name,
            path=table["path"],
            interpreter=table["interpreter"],
            allow_loader_env=table.get("allow_loader_env", False),
        )
    return runtimes


def _telemetry(path: Path, raw: Mapping[str, Any]) -> dict[str, Any]:
    """[telemetry], checked; an integer interval (``system_interval_s = 5``) is accepted."""
    table = dict(raw)
    if type(table.get("system_interval_s")) is int:
        table["system_interval_s"] = float(table["system_interval_s"])
    check_table(path, "telemetry", table, _TELEMETRY_KEYS)
    interval = table.get("system_interval_s")
    if interval is not None and not 0 <= interval <= MAX_SYSTEM_INTERVAL_S:
        raise NodeConfigError(
            f"{path}: 'telemetry.system_interval_s' is {interval}; give 0 (no GPU and process "
            f"samples) to {MAX_SYSTEM_INTERVAL_S:g} seconds."
        )
    files = table.get("max_files")
    if files is not None and not 1 <= files <= MAX_TELEMETRY_FILES:
        raise NodeConfigError(
            f"{path}: 'telemetry.max_files' is {files}; give 1 to {MAX_TELEMETRY_FILES} (the "
            "most telemetry files one member's collector follows at once; 256 when unset)."
        )
    return table


def load(path: Path) -> dict[str, Any]:
    """Read and check node.toml; returns only known keys with values of the right type."""
    try:
        with path.open("rb") as fh:
            raw = tomllib.load(fh)
    except OSError as exc:
        raise NodeConfigError(f"Cannot read {path}: {exc.strerror}. Check the path.") from None
    except tomllib.TOMLDecodeError as exc:
        raise NodeConfigError(f"{path} is not valid TOML ({exc}). Fix the syntax.") from None
    for key, value in raw.items():
        if key not in _KEYS:
            known = ", ".join(sorted(_KEYS))
            raise NodeConfigError(
                f"{path}: unknown key '{key}'. Known keys are {known}; remove or rename it."
            )
        kind = _KEYS[key][0]
        if not isinstance(value, kind):
            if kind is dict:
                raise NodeConfigError(
                    f"{path}: '{key}' must be a table ([{key}]), not {type(value).__name__}."
                )
            raise NodeConfigError(
                f"{path}: '{key}' must be a {kind.__name__}, not {type(value).__name__} "
                f'({value!r}). Quote it, e.g. {key} = "...".'
            )
    workload_policy(raw, path, euid=None)
    if "telemetry" in raw:
        raw["telemetry"] = _telemetry(path, raw["telemetry"])
    metrics_settings(raw, path)
    outputs_settings(raw, path)
    images_settings(raw, path)
    registries_settings(raw, path, read_files=False)
    return dict(raw)


@attrs.frozen
class OutputsSettings:
    """node.toml's [outputs]: ``listen`` (HOST:PORT, "" when the listener is off; port 0 picks
    a free one) and ``advertise`` (the host other Nodes dial; "" for this Node's own address)."""

    listen: str = DEFAULT_OUTPUTS_LISTEN
    advertise: str = ""

    @property
    def on(self) -> bool:
        return bool(self.listen)

    def host_port(self) -> tuple[str, int]:
        """``listen`` split (checked by :func:`outputs_settings`); only when :attr:`on`."""
        found = split_host_port(self.listen, allow_zero=True)
        assert found is not None, "outputs_settings checked listen"
        return found


def _is_ip_or_name(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return bool(_HOST_NAME.match(host))
    return True


def outputs_settings(settings: Mapping[str, Any], path: Path | None = None) -> OutputsSettings:
    """The outputs listener node.toml asks for: on at 0.0.0.0:7463 unless [outputs] says
    otherwise; ``listen = ""`` turns it off. A malformed value names the key and the fix."""
    where = path or DEFAULT_PATH
    raw = settings.get("outputs", {})
    check_table(where, "outputs", raw, _OUTPUTS_KEYS)
    listen = raw.get("listen", DEFAULT_OUTPUTS_LISTEN).strip()
    advertise = raw.get("advertise", "").strip()
    if listen:
        found = split_host_port(listen, allow_zero=True)
        if found is None or not _is_ip_or_name(found[0]):
            raise NodeConfigError(
                f"{where}: 'outputs.listen' is {listen!r}, which is not HOST:PORT; give the "
                f'address to listen on, e.g. listen = "{DEFAULT_OUTPUTS_LISTEN}" (IPv6: '
                '"[::]:7463"), or listen = "" to serve no outputs.'
            )
    if advertise and not _is_ip_or_name(advertise.strip("[]")):
        raise NodeConfigError(
            f"{where}: 'outputs.advertise' is {advertise!r}, which is not a host name or an IP "
            'address; give the host other Nodes dial (no port), e.g. advertise = "10.0.0.5", '
            "or remove it to use this Node's own address."
        )
    return OutputsSettings(listen=listen, advertise=advertise.strip("[]"))


@attrs.frozen
class ImagesSettings:
    """node.toml's [images]: ``max_bytes``, the image cache's size limit (None: no limit)."""

    max_bytes: int | None = None


def images_settings(settings: Mapping[str, Any], path: Path | None = None) -> ImagesSettings:
    """The image cache's settings: ``max_size`` in bytes (an integer) or with a unit
    (``"50GiB"``, ``"500GB"``); no limit without it. A malformed value names the key and the fix."""
    where = path or DEFAULT_PATH
    raw = settings.get("images", {})
    for key in raw:
        if key != "max_size":
            raise NodeConfigError(
                f"{where}: unknown key 'images.{key}'. The known key of [images] is max_size; "
                "remove or rename it."
            )
    if "max_size" not in raw:
        return ImagesSettings()
    value = raw["max_size"]
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise NodeConfigError(
            f"{where}: 'images.max_size' must be bytes (an integer) or a string with a unit, "
            f'not {type(value).__name__} ({value!r}); e.g. max_size = "50GiB".'
        )
    try:
        return ImagesSettings(parse_size(value))
    except ValueError as exc:
        raise NodeConfigError(f"{where}: 'images.max_size': {exc}") from None


def metrics_settings(
    settings: Mapping[str, Any], path: Path | None = None
) -> MetricsListener | None:
    """The Prometheus listener node.toml asks for: None (off) without a [metrics] table; with
    one, ``port`` (default 7447) on ``host`` (default 127.0.0.1, this machine only)."""
    if "metrics" not in settings:
        return None
    try:
        return metrics_listener(settings["metrics"], DEFAULT_NODE_PORT)
    except MetricsConfigError as exc:
        raise NodeConfigError(f"{path or DEFAULT_PATH}: {exc}") from None


def workload_policy(
    settings: Mapping[str, Any], path: Path | None = None, euid: int | None = None
) -> WorkloadPolicy:
    """The workload policy node.toml's settings describe (the safe default where it is silent).

    ``euid`` (the agent's effective uid) picks the default when there is no [accounts] table;
    ``None`` only checks the settings.
    """
    where = path or DEFAULT_PATH
    isolation = settings.get("isolation", "none")
    if isolation not in ISOLATIONS:
        raise NodeConfigError(
            f"{where}: 'isolation' is {isolation!r}; set it to "
            f"{' or '.join(repr(i) for i in ISOLATIONS)}."
        )
    runtimes = _runtimes(where, settings.get("runtimes", {}))
    if "accounts" in settings:
        mode, pool = _accounts(where, settings["accounts"])
        return WorkloadPolicy(mode=mode, pool=pool, isolation=isolation, runtimes=runtimes)
    base = default_policy(os.geteuid() if euid is None else euid)
    return attrs.evolve(base, isolation=isolation, runtimes=runtimes)


def default_map(settings: Mapping[str, Any]) -> dict[str, Any]:
    """click's ``default_map`` for the ``tuneplane-node`` group built from node.toml settings."""
    defaults: dict[str, Any] = {}
    for key, value in settings.items():
        if key == "telemetry" and "system_interval_s" in value:
            defaults.setdefault("run", {})["system_interval_s"] = value["system_interval_s"]
        if key == "telemetry" and "max_files" in value:
            defaults.setdefault("run", {})["telemetry_max_files"] = value["max_files"]
        for command in _KEYS[key][1]:
            if command in _GROUPS:
                group = defaults.setdefault(command, {})
                for sub in _GROUPS[command]:
                    group.setdefault(sub, {})[key] = value
            else:
                defaults.setdefault(command, {})[key] = value
    return defaults
