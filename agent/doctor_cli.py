"""``tuneplane-node doctor``: check everything the agent needs, each as an ok/warn/FAIL line.

Rules: it opens the journal read-only and never needs the daemon; it reads the GPUs as the
agent reads them, but leaves NVML alone while an operator's release is in force; any FAIL makes
its exit status 1. The checks themselves are agent/doctor.py's and agent/workload_checks.py's.
"""

from __future__ import annotations

import time
from pathlib import Path

import click

from . import config as node_config
from . import doctor, image_checks, journal_read, workload_checks
from .cli_gpu_source import scripted_nvml_option
from .cli_settings import images_settings, outputs_settings, roots, workload_policy
from .cli_support import image_root_option, state_dir_option
from .image_store import cache_directory
from .inventory import Inventory, InventoryError, default_node_name
from .inventory_source import PROBE_LIMIT_S, RELEASE_REQUEST, InventorySource, read_release
from .journal_owner import owner_problem, stamped_node_id
from .state_dir import NodeConfig, StateDir, StateDirError, read_status
from .status_cli import credential_line, gib, pid_alive
from .xid_book import CLEAR_KINDS


def _doctor_inventory(
    state: StateDir, node_name: str, scripted_nvml: Path | None
) -> Inventory | str | None:
    """What doctor reads the GPUs from: the inventory, why it failed, or None while released."""
    if read_release(state.root / RELEASE_REQUEST) > int(time.time() * 1000):
        return None
    try:
        return InventorySource(node_name, None, scripted_nvml).collect_within(PROBE_LIMIT_S)
    except InventoryError as exc:
        return str(exc)


def _gpu_doctor_lines(
    state: StateDir, read: Inventory | str | None
) -> list[tuple[bool | None, str]]:
    """What NVML says, read as the agent reads it: (ok, text); ``None`` is a plain detail."""
    if read is None:
        released = read_release(state.root / RELEASE_REQUEST)
        until = time.strftime("%H:%M:%S", time.gmtime(released / 1000))
        return [
            (
                True,
                f"NVML is released for a GPU reset until {until} UTC (tuneplane-node gpu "
                "release); doctor leaves it alone too",
            )
        ]
    if isinstance(read, str):
        return [(False, read)]
    inv = read
    where = f" ({inv.gpu_source})" if inv.gpu_source != "nvml" else ""
    if inv.problem:
        lines: list[tuple[bool | None, str]] = [(False, f"NVML{where}: {inv.problem}")]
    elif not inv.gpus:
        devices = sorted(str(p) for p in Path("/dev").glob("nvidia[0-9]*"))
        if inv.gpu_source == "none" and devices:
            return [
                (
                    False,
                    f"{inv.note}, but {devices[0]} exists: the driver's user-space libraries "
                    "(libnvidia-ml.so.1) are missing or not on the library path; reinstall the "
                    "driver package",
                )
            ]
        return [(True, inv.note or f"NVML{where}: no GPUs")]
    else:
        lines = [
            (
                True,
                f"NVML{where}: {len(inv.gpus)} GPUs, driver {inv.driver_version or '?'}, "
                f"CUDA {inv.cuda_version or '?'}",
            )
        ]
    for gpu in inv.gpus:
        health = "healthy" if gpu.healthy else f"UNHEALTHY: {gpu.health_reason}"
        mig = ", MIG enabled" if gpu.mig_enabled else ""
        lines.append((gpu.healthy, f"GPU {gpu.index} {gpu.uuid} {gpu.name}{mig}: {health}"))
        for dev in gpu.mig_devices:
            lines.append((None, f"  MIG device {dev.uuid} {dev.profile} {gib(dev.memory_bytes)}"))
    if inv.xid_events:
        events_ok = inv.xid_events.startswith("registered on all")
        lines.append((events_ok, f"XID events: {inv.xid_events}"))
    return lines


@click.command("doctor")
@state_dir_option
@image_root_option
@scripted_nvml_option
@click.option(
    "--check-all-blobs",
    is_flag=True,
    help="Re-hash every blob of the image cache (default: up to 2 GiB of them, sampled).",
)
def doctor_command(
    state_dir: Path, image_root: Path | None, scripted_nvml: Path | None, check_all_blobs: bool
) -> None:
    """Check the state dir, the credential, the journal, the GPU source and NVML, the runtimes,
    the coordinator's address and clock, free disk space, and the image cache."""
    state = StateDir(state_dir)
    failures = 0
    node: NodeConfig | None = None

    def line(ok: bool, text: str) -> None:
        nonlocal failures
        failures += not ok
        click.echo(f"{'ok  ' if ok else 'FAIL'}  {text}")

    def finding(found: workload_checks.Finding) -> None:
        nonlocal failures
        failures += found.level == "FAIL"
        click.echo(f"{found.level.ljust(4)}  {found.text}")

    node_id = ""
    node_name = default_node_name()
    problems = state.permission_problems()
    line(not problems, "state dir permissions" + (": " + " ".join(problems) if problems else ""))
    try:
        node = state.load_node()
        node_id = node.node_id
        node_name = node.name
        line(True, f"enrolled as Node {node.node_id} with {node.coordinator}")
        line(Path(node.ca).is_file(), f"CA file {node.ca}")
    except StateDirError as exc:
        line(False, str(exc))
    try:
        state.read_credential()
        line(True, f"control credential present ({state.control_token})")
        level, text = credential_line(state)
        if level == "warn":
            click.echo(f"warn  {text}")
        else:
            line(level == "ok", text)
    except StateDirError as exc:
        line(False, str(exc))
    try:
        with journal_read.open_readonly(state.journal_path) as db:
            bad = journal_read.integrity_problems(db)
            stamped = None if bad else stamped_node_id(db)
        detail = (": " + "; ".join(bad[:3])) if bad else ""
        line(not bad, f"journal integrity {state.journal_path}{detail}")
        if not bad and node_id:
            problem = owner_problem(state.journal_path, stamped, node_id)
            line(problem is None, f"journal owner: {problem or 'Node ' + node_id}")
    except journal_read.JournalUnreadable as exc:
        line(False, f"journal integrity: {exc} The agent runs in safe mode until it is repaired.")
    read = _doctor_inventory(state, node_name, scripted_nvml)
    status = read_status(state.status_path) or {}
    if read is not None:  # None: NVML is released, the GPU line below says so
        pid = status.get("pid")
        running = pid if pid_alive(pid) and isinstance(pid, int) else None
        mine, count = (
            (read.gpu_source, len(read.gpus))
            if isinstance(read, Inventory)
            else ("nothing (its GPU read failed, see below)", 0)
        )
        finding(
            doctor.inventory_source_finding(running, status.get("inventory") or {}, mine, count)
        )
    for ok, text in _gpu_doctor_lines(state, read):
        if ok is None:
            click.echo(f"      {text}")
        else:
            line(ok, text)
    for text in _xid_doctor_lines(state):
        click.echo(text)
    failures += _workload_lines(state.root)
    if node is not None:
        finding(doctor.probe_coordinator(node.coordinator, Path(node.ca)))
        gateway = doctor.telemetry_address(state.root)
        if gateway:
            finding(doctor.probe_coordinator(gateway, Path(node.ca), listener="telemetry"))
        else:
            click.echo(
                "      coordinator telemetry address: not known yet (the coordinator hands it "
                "out with each Commit; this Node has had none)"
            )
        skew = status.get("clock_skew_ms")
        at = status.get("clock_skew_at_ms")
        finding(
            doctor.skew_finding(
                skew if isinstance(skew, int) else None,
                at if isinstance(at, int) else None,
                int(time.time() * 1000),
            )
        )
    # The roots the agent last ran with (status.json), else those node.toml or the defaults set.
    works, outputs = roots(state.root)
    works = Path(status.get("work_root") or works)
    outputs = Path(status.get("out_root") or outputs)
    for label, root in (("state dir", state.root), ("work root", works), ("output root", outputs)):
        finding(doctor.measure_disk(label, root))
    # The image root likewise: the agent's, else --image-root (node.toml) or the default.
    images = Path(status.get("image_root") or cache_directory(state.root, image_root))
    for found in _image_findings(images, check_all_blobs):
        finding(found)
    served, _ = outputs_settings()
    pid = status.get("pid")
    finding(
        doctor.outputs_finding(
            served.listen,
            pid_alive(pid),
            str(status.get("outputs_listen") or ""),
            str(status.get("outputs_address") or ""),
        )
    )
    if failures:
        raise SystemExit(1)


def _image_findings(directory: Path, check_all: bool) -> list[workload_checks.Finding]:
    """The image cache's integrity and free space (agent/image_checks.py)."""
    try:
        limit = images_settings()
    except node_config.NodeConfigError as exc:
        return [workload_checks.Finding("FAIL", str(exc))]
    budget = None if check_all else image_checks.HASH_BUDGET_BYTES
    return image_checks.cache_findings(directory, limit, budget)


def _xid_doctor_lines(state: StateDir) -> list[str]:
    """Doctor's XID lines from the journal: each GPU XIDs disable (warn), then the history."""
    try:
        with journal_read.open_readonly(state.journal_path) as db:
            disabled = journal_read.disabled_gpus(db)
            book = journal_read.xid_book(db)
    except journal_read.JournalUnreadable:
        return []  # the journal lines above already said why
    lines = [
        f"warn  GPU {d['gpu_uuid']} is disabled by {d['why']}; after a reset or a check run "
        f"`tuneplane-node gpu clear {d['gpu_uuid']} --reason ...`"
        for d in disabled
    ]
    application = sum(x.application for x in book.xids)
    clears = sum(e.kind in CLEAR_KINDS for e in book.events)
    lines.append(
        f"      XID history: {len(book.xids)} XIDs journaled ({application} application, "
        f"counted only), {clears} clears; `tuneplane-node journal gpus` lists them"
    )
    return lines


def _workload_lines(state_dir: Path) -> int:
    """Print doctor's workload-policy lines (accounts, runtimes, bubblewrap); the failures."""
    try:
        policy = workload_policy()
    except node_config.NodeConfigError as exc:
        click.echo(f"FAIL  {exc}")
        return 1
    works, outputs = roots(state_dir)
    failures = 0
    for finding in workload_checks.doctor_findings(policy, state_dir, works, outputs):
        failures += finding.level == "FAIL"
        click.echo(f"{finding.level.ljust(4)}  {finding.text}")
    return failures
