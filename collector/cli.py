"""``tuneplane-collector``: the collector's command line.

``inspect`` decodes telemetry files exactly as the collector would ship them, with every
warning, and needs no coordinator.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
import time
from pathlib import Path

import click

from tuneplane.agent import daemon_log

from .defaults import DEFAULT_MAX_DEPTH, DEFAULT_MAX_ENTRIES, DEFAULT_MAX_FILES
from .files import (
    Layout,
    ScanLimits,
    TelemetryPathError,
    discover,
    kind_of,
    points_in_run,
    read_file,
    telemetry_files,
)
from .point_rules import PointScreen
from .points import ReadWarning, ScalarPoint
from .spool import DEFAULT_MAX_POINTS

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Log what the collector does to stderr.")
def main(verbose: bool) -> None:
    """TunePlane's telemetry collector: TensorBoard event files and JSONL metrics."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format=LOG_FORMAT, stream=sys.stderr
    )


def _collect(path: Path, output_dir: bool) -> tuple[list[ScalarPoint], list[ReadWarning]]:
    layout = Layout()
    if output_dir:
        if not path.is_dir():
            raise click.BadParameter(
                f"{path} is not a directory; --output-dir takes a member's $TUNEPLANE_OUT_DIR",
                param_hint="PATH",
            )
        root = path
        layout = Layout.output_dir()
        files = [path / rel for rel, _ in discover(path, layout, ScanLimits()).files]
    elif path.is_dir():
        root = path
        files = list(telemetry_files(path))
    else:
        root = path.parent
        files = [path]
        if kind_of(path.name) is None:
            raise click.BadParameter(
                f"{path} is not a telemetry file: names must contain 'tfevents' (TensorBoard) "
                "or '.jsonl' (JSON lines). Rename it or give its directory",
                param_hint="PATH",
            )
    points: list[ScalarPoint] = []
    warnings: list[ReadWarning] = []
    for file in files:
        source = file.relative_to(root).as_posix()
        try:
            found, problems = read_file(file, source)
        except OSError as exc:
            raise click.ClickException(f"cannot read {file}: {exc.strerror}") from None
        # As the collector names them: a file's run (its directory) in front of its tags.
        points += points_in_run(layout.run(source), found)
        warnings += problems
    # As the tailer does: a point the gateway would refuse is shown as the warning it becomes.
    points, refused = PointScreen().screen(points, time.time())
    return points, warnings + refused


def _when(wall_time: float | None) -> str:
    if wall_time is None:
        return "-"
    moment = datetime.datetime.fromtimestamp(wall_time, tz=datetime.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


@main.command()
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@click.option(
    "--json", "as_json", is_flag=True, help="One JSON object per line instead of a table."
)
@click.option(
    "--output-dir",
    is_flag=True,
    help="PATH is a member's $TUNEPLANE_OUT_DIR: read the files the collector follows there "
    "(its telemetry directory, event and tuneplane.report files anywhere), tags under their run.",
)
def inspect(path: Path, as_json: bool, output_dir: bool) -> None:
    """Decode PATH (a telemetry file, or a directory searched recursively) as the collector
    would: every scalar point (source file and byte offset, tag, step, wall time, value) and
    every warning about data that will not be shipped."""
    points, warnings = _collect(path, output_dir)
    if as_json:
        out = sys.stdout
        for p in points:
            record = {
                "type": "point",
                "source": p.source,
                "offset": p.offset,
                "index": p.index,
                "tag": p.tag,
                "step": p.step,
                "wall_time": p.wall_time,
                "value": p.value,
            }
            out.write(json.dumps(record) + "\n")
        for w in warnings:
            record = {
                "type": "warning",
                "source": w.source,
                "offset": w.offset,
                "line": w.line,
                "kind": w.kind,
                "data_loss": w.data_loss,
                "message": w.message,
            }
            out.write(json.dumps(record) + "\n")
        return
    # Here, not at the top: every member's collector imports this module to run, and rich
    # (about 50 ms of CPU to import) is only for this table.
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"scalars in {path}")
    for column in ("source", "offset", "tag", "step", "wall time (UTC)", "value"):
        right = column in ("offset", "step", "value")
        # Fold rather than cut: a truncated file name or value would mislead.
        table.add_column(column, justify="right" if right else "left", overflow="fold")
    for p in points:
        table.add_row(
            p.source, str(p.offset), p.tag, str(p.step), _when(p.wall_time), repr(p.value)
        )
    console.print(table)
    for w in warnings:
        label = "data loss" if w.data_loss else "note"
        console.print(f"[bold red]{label}[/] ({w.kind}) {w.describe()}", highlight=False)
    lost = sum(1 for w in warnings if w.data_loss)
    console.print(f"{len(points)} points, {len(warnings)} warnings ({lost} data loss)")


@main.command()
@click.option(
    "--telemetry-dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="The member's telemetry directory ($TUNEPLANE_TELEMETRY_DIR); followed recursively.",
)
@click.option(
    "--out-dir",
    default=None,
    type=click.Path(file_okay=False, path_type=Path),
    help="The member's output directory ($TUNEPLANE_OUT_DIR), holding --telemetry-dir: also "
    "follow TensorBoard event files and tuneplane.report files anywhere under it.",
)
@click.option(
    "--max-files",
    default=DEFAULT_MAX_FILES,
    show_default=True,
    type=click.IntRange(min=1),
    help="The most telemetry files followed at once; more are reported, not read.",
)
@click.option(
    "--max-depth",
    default=DEFAULT_MAX_DEPTH,
    show_default=True,
    type=click.IntRange(min=1),
    help="How many directories deep the search for telemetry files goes.",
)
@click.option(
    "--max-entries",
    default=DEFAULT_MAX_ENTRIES,
    show_default=True,
    type=click.IntRange(min=1),
    help="The most directory entries one search for telemetry files looks at.",
)
@click.option(
    "--state-dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Private, host-local directory for the spool, the checkpoint and the markers.",
)
@click.option(
    "--gateway",
    "gateways",
    required=True,
    multiple=True,
    metavar="HOST:PORT",
    help="The telemetry gateway. Repeat it for each coordinator that shares the store: the "
    "first is called first, and when a call fails the next is tried at once.",
)
@click.option(
    "--ca",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The CA certificate that must vouch for the gateway (the coordinator's tls/ca.pem).",
)
@click.option(
    "--credential-file",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="The member's collector credential (0600), read again before every call.",
)
@click.option("--run-id", required=True, help="The Job's run id.")
@click.option("--attempt", required=True, type=click.IntRange(min=1), help="The attempt number.")
@click.option("--member", required=True, type=click.IntRange(min=0), help="The member index.")
@click.option(
    "--max-spool-points",
    default=DEFAULT_MAX_POINTS,
    show_default=True,
    type=click.IntRange(min=1),
    help="Spool limit; when reached, reading pauses until points are delivered.",
)
@click.option(
    "--agent-pid",
    default=None,
    type=click.IntRange(min=1),
    help="The pid of the tuneplane-node that started this collector; the collector stops when "
    "it is no longer its parent (also when the agent died before the collector looked).",
)
@click.option(
    "--poll-interval",
    default=0.5,
    show_default=True,
    type=click.FloatRange(min=0.01),
    help="Seconds between looks at the telemetry files and the member-exited marker.",
)
@click.option(
    "--system-interval",
    default=0.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Seconds between GPU and process samples (system/... series); 0 takes none.",
)
@click.option(
    "--gpu",
    "gpus",
    multiple=True,
    metavar="UUID",
    help="A GPU of the member, by NVML UUID, in the member's order (system/gpu<rank>/...); "
    "repeat it for each.",
)
@click.option(
    "--member-dir",
    default=None,
    type=click.Path(file_okay=False, path_type=Path),
    help="The member's directory on the Node, whose runner.json names the runner whose process "
    "tree is sampled (system/cpu_percent, system/rss_bytes).",
)
@click.option(
    "--scripted-nvml",
    default=None,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Read the GPUs through the scripted NVML test double driven by FILE (as the agent).",
)
@click.option(
    "--gpu-release-file",
    default=None,
    type=click.Path(dir_okay=False, path_type=Path),
    help="The agent's GPU release request; while it is in force the collector lets go of NVML.",
)
@click.option(
    "--source-prefix",
    default="",
    help="Put this in front of every followed file's source id (its points' dedup identity), "
    "so a second run of the member that writes the same files again (a Slurm job Slurm "
    "requeued: restart-<r>/) has its points stored beside the first run's, not dropped as "
    "their duplicates.",
)
def run(
    telemetry_dir: Path,
    out_dir: Path | None,
    max_files: int,
    max_depth: int,
    max_entries: int,
    state_dir: Path,
    gateways: tuple[str, ...],
    ca: Path,
    credential_file: Path,
    run_id: str,
    attempt: int,
    member: int,
    max_spool_points: int,
    agent_pid: int | None,
    poll_interval: float,
    system_interval: float,
    gpus: tuple[str, ...],
    member_dir: Path | None,
    scripted_nvml: Path | None,
    gpu_release_file: Path | None,
    source_prefix: str,
) -> None:
    """Follow one member's telemetry, spool it durably and ship it to the telemetry gateway
    exactly once; with --system-interval, also sample the member's GPUs and processes as its
    system/... series (docs/telemetry.md). Exits 0 once the member exited
    (STATE_DIR/member-exited appears) and every point was delivered (STATE_DIR/drained is
    written), or when stopped by SIGTERM/SIGINT."""
    import trio

    from .checkpoint import CheckpointError

    # A long-running service: what it does (spooled, shipped, retried) belongs in its log,
    # which is journald's under systemd (the agent hands it its own stderr then), every entry
    # naming the member so `journalctl TUNEPLANE_MEMBER=…` shows its collector with its agent.
    daemon_log.configure(
        logging.INFO,
        "tuneplane-collector",
        LOG_FORMAT,
        fields={
            "run_id": run_id,
            "attempt": str(attempt),
            "member_index": str(member),
            "member": f"{run_id}.{attempt}.{member}",
        },
    )
    from .files import ScanLimits
    from .options import CollectorOptions, followed_root
    from .service import run_collector
    from .ship_wire import CollectorConfigError, Gateway
    from .spool import SpoolError
    from .system_sampler import SystemOptions

    try:
        # A gateway named twice is called once per round, where it was first named.
        first, *fallbacks = dict.fromkeys(Gateway.parse(text) for text in gateways)
        opts = CollectorOptions(
            telemetry_dir=telemetry_dir.absolute(),
            state_dir=state_dir.absolute(),
            gateway=first,
            fallbacks=tuple(fallbacks),
            ca=ca,
            credential_file=credential_file,
            run_id=run_id,
            attempt=attempt,
            member_index=member,
            max_spool_points=max_spool_points,
            poll_interval_s=poll_interval,
            agent_pid=agent_pid,
            system=SystemOptions(
                interval_s=system_interval,
                gpu_uuids=gpus,
                member_dir=member_dir.absolute() if member_dir else None,
                scripted_nvml=scripted_nvml.absolute() if scripted_nvml else None,
                gpu_release_file=gpu_release_file,
            ),
            out_dir=out_dir.absolute() if out_dir else None,
            limits=ScanLimits(max_files, max_depth, max_entries),
            source_prefix=source_prefix,
        )
        followed_root(opts)  # a telemetry directory outside --out-dir is refused here
        sys.exit(trio.run(run_collector, opts))
    except (CollectorConfigError, CheckpointError, SpoolError, TelemetryPathError) as exc:
        raise click.UsageError(str(exc)) from None


if __name__ == "__main__":
    main()
