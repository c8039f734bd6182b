"""``tuneplane-node doctor``'s checks that look beyond the state dir: which GPU source is in use,
the runtimes' interpreters, the coordinator's control address, the clock and free disk space.

Each check returns :class:`Finding` lines (``ok``, ``warn`` or ``FAIL`` and a sentence with what to
do). The deciding parts are pure functions of what was measured, so they are tested without a
network or a full disk; the small measuring functions beside them do the I/O, each time-limited.
"""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .collectors import COLLECTORS_DIR, CONFIG_FILE
from .wire import Endpoint, TlsVerificationFailed, client_tls
from .workload_checks import Finding

REACH_LIMIT_S = 5.0
# Free space: below the warning level a few checkpoints fill the disk; below the failure level a
# member's next write (or the journal's) can fail.
DISK_WARN_BYTES = 5 * 2**30
DISK_WARN_FRACTION = 0.05
DISK_FAIL_BYTES = 2**30
# Clock skew: heartbeats and credential lifetimes are compared across the two clocks.
SKEW_WARN_MS = 2_000
SKEW_FAIL_MS = 60_000
SIMULATED_SOURCES = ("simulated", "scripted-nvml")


def _gpus(count: int) -> str:
    return f"{count} GPU" + ("" if count == 1 else "s")


def inventory_source_finding(
    agent_pid: int | None, agent_inventory: Mapping[str, Any], doctor_source: str, doctor_gpus: int
) -> Finding:
    """Whether doctor reads the GPUs from where the running agent does (``agent_pid`` None: none
    runs; ``agent_inventory``: the ``inventory`` object of its status file)."""
    mine = f"doctor reads {doctor_source} ({_gpus(doctor_gpus)})"
    if agent_pid is None:
        last = agent_inventory.get("gpu_source")
        before = f"; the last agent used {last}" if last else ""
        return Finding("ok", f"inventory source: {mine}; no agent is running{before}")
    source = str(agent_inventory.get("gpu_source") or "unknown")
    count = len(agent_inventory.get("gpus") or [])
    theirs = f"the running agent (pid {agent_pid}) uses {source} ({_gpus(count)})"
    if source == doctor_source:
        return Finding("ok", f"inventory source: {theirs}, and {mine} too")
    if source in SIMULATED_SOURCES:
        return Finding(
            "warn",
            f"inventory source: {theirs}, not the driver, while {mine}: the GPU lines below are "
            f"what doctor read, not what the agent schedules on. Restart the agent without "
            f"--simulate-gpus/--scripted-nvml to use this host's GPUs, or pass doctor the same "
            f"--scripted-nvml file.",
        )
    return Finding(
        "FAIL",
        f"inventory source: {theirs}, but {mine}: the agent and doctor see different GPUs. "
        "Check the agent's environment (LD_LIBRARY_PATH, the driver's libnvidia-ml.so.1) and "
        "restart it.",
    )


def reach_finding(
    address: str,
    error: str | None,
    handshake_s: float,
    protocol: str = "TLS",
    listener: str = "control",
) -> Finding:
    """A listener's line from a measured TCP+TLS attempt (``error`` None: it worked)."""
    if error is None:
        return Finding(
            "ok",
            f"coordinator {listener} address {address} is reachable: {protocol} handshake "
            f"verified with the Node's CA in {handshake_s * 1000:.0f} ms",
        )
    fix = (
        "or enroll again with the `control` address of its endpoints.json"
        if listener == "control"
        else 'or set the address the coordinator hands out (docs/operator.md, "Addresses")'
    )
    return Finding(
        "FAIL",
        f"coordinator {listener} address {address} is not reachable: {error}. Check that the "
        f"coordinator runs and that this host may reach {address} (firewall, routing), {fix}.",
    )


def probe_coordinator(
    address: str, ca: Path, limit_s: float = REACH_LIMIT_S, listener: str = "control"
) -> Finding:
    """Open TCP to one of the coordinator's listeners (``control``, ``telemetry``) and complete
    a TLS handshake verified with ``ca``; no credential is sent."""
    try:
        endpoint = Endpoint.parse(address)
        ctx = client_tls(ca)
    except (ValueError, TlsVerificationFailed) as exc:
        return Finding("FAIL", f"coordinator {listener} address cannot be checked: {exc}")
    started = time.monotonic()
    try:
        with (
            socket.create_connection((endpoint.host, endpoint.port), timeout=limit_s) as raw,
            ctx.wrap_socket(raw, server_hostname=endpoint.host) as tls,
        ):
            protocol = tls.version() or "TLS"
    except ssl.SSLCertVerificationError as exc:
        why = f"its certificate does not verify with {ca} ({exc.verify_message})"
        return reach_finding(address, why, 0.0, listener=listener)
    except TimeoutError:
        return reach_finding(address, f"no answer within {limit_s:g} s", 0.0, listener=listener)
    except (OSError, ssl.SSLError) as exc:
        return reach_finding(address, exc.strerror or str(exc), 0.0, listener=listener)
    return reach_finding(address, None, time.monotonic() - started, protocol, listener)


def telemetry_address(state_root: Path) -> str:
    """The telemetry gateway address of the newest Commit (its collector.json), or "" when
    this Node has had no Commit: the coordinator hands the address out with each one."""
    newest = ("", -1)
    for config in (state_root / COLLECTORS_DIR).glob(f"*/{CONFIG_FILE}"):
        try:
            mtime = config.stat().st_mtime_ns
            gateway = json.loads(config.read_text()).get("gateway", "")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(gateway, str) and gateway and mtime > newest[1]:
            newest = (gateway, mtime)
    return newest[0]


def skew_finding(skew_ms: int | None, measured_at_ms: int | None, now_ms: int) -> Finding:
    """The clock skew the agent measured at its last Welcome (coordinator minus this host)."""
    if skew_ms is None or measured_at_ms is None:
        return Finding(
            "warn",
            "clock skew to the coordinator: unknown, the agent has not connected since it "
            "started (it measures it from the coordinator's Welcome); start the agent and run "
            "doctor again.",
        )
    age = max(0.0, (now_ms - measured_at_ms) / 1000)
    ahead = "ahead of" if skew_ms >= 0 else "behind"
    text = (
        f"clock skew to the coordinator: its clock is {abs(skew_ms) / 1000:.1f} s {ahead} this "
        f"host's (measured by the agent at its last Welcome, {age:.0f} s ago)"
    )
    if abs(skew_ms) < SKEW_WARN_MS:
        return Finding("ok", text)
    fix = "; run NTP (chrony or systemd-timesyncd) on both hosts"
    return Finding("warn" if abs(skew_ms) < SKEW_FAIL_MS else "FAIL", text + fix)


def disk_finding(label: str, path: Path, free: int, total: int) -> Finding:
    """Free space under one root: warn under 5 GiB or 5 %, fail under 1 GiB."""
    share = free / total if total else 0.0
    text = (
        f"disk space under the {label} {path}: {free / 2**30:.1f} GiB free of "
        f"{total / 2**30:.1f} GiB ({share:.0%})"
    )
    if free < DISK_FAIL_BYTES:
        return Finding("FAIL", text + "; free space there before members write, or move the root")
    if free < DISK_WARN_BYTES or share < DISK_WARN_FRACTION:
        return Finding("warn", text + "; members' outputs and checkpoints may soon fill it")
    return Finding("ok", text)


def measure_disk(label: str, path: Path) -> Finding:
    """``disk_finding`` for ``path``, measured on its nearest existing folder."""
    where = path
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        usage = shutil.disk_usage(where)
    except OSError as exc:
        return Finding("FAIL", f"disk space under the {label} {path} cannot be read: {exc}")
    return disk_finding(label, path, usage.free, usage.total)


def outputs_finding(listen: str, agent_running: bool, bound: str, advertised: str) -> Finding:
    """The outputs listener's line: ``listen`` is node.toml's setting ("" turns it off);
    ``bound`` and ``advertised`` are what the running agent's status file says."""
    if not listen:
        return Finding(
            "ok",
            'outputs listener: off ([outputs] listen = ""); this Node\'s runs cannot be the '
            "source of an --init-from on another Node unless the Fleet shares its output root",
        )
    if not agent_running:
        return Finding(
            "ok",
            f"outputs listener: the agent would listen at {listen} ([outputs] listen); no agent "
            "is running",
        )
    if not bound:
        return Finding(
            "warn",
            f"outputs listener: node.toml asks for {listen}, but the running agent serves no "
            "outputs; restart it to apply node.toml",
        )
    said = advertised or "not yet said (the agent has not said Hello since it started)"
    return Finding(
        "ok",
        f"outputs listener: listening at {bound}, advertised to other Nodes as {said}; they "
        "must reach that port (TCP, TLS)",
    )
