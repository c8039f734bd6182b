"""What one member's collector is told (:class:`CollectorOptions`) and what it follows.

Rules: what is followed: with ``out_dir``, the member's whole ``$TUNEPLANE_OUT_DIR`` (its
telemetry directory inside it), else the telemetry directory alone; a checkpoint written by a
collector that followed the telemetry directory alone keeps it so (its stream names are relative
to it). See :mod:`tuneplane.collector.files` for which files count and the bounds.
"""

from __future__ import annotations

import logging
from pathlib import Path

import attrs

from .checkpoint import load_checkpoint
from .files import Layout, ScanLimits, TelemetryPathError
from .ship_wire import Gateway
from .spool import DEFAULT_MAX_POINTS
from .system_sampler import SystemOptions

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.json"
PROGRESS_INTERVAL_S = 5.0


@attrs.frozen
class CollectorOptions:
    """One member's collector. ``state_dir`` is private to the Node (spool, checkpoint, markers)."""

    telemetry_dir: Path
    state_dir: Path
    gateway: Gateway
    ca: Path
    credential_file: Path
    run_id: str
    attempt: int
    member_index: int
    max_spool_points: int = DEFAULT_MAX_POINTS
    poll_interval_s: float = 0.5
    progress_interval_s: float = PROGRESS_INTERVAL_S
    # The agent that started this collector; None: whatever process is the parent at start.
    agent_pid: int | None = None
    # The member's GPU and process samples (docs/telemetry.md, "System series").
    system: SystemOptions = attrs.field(factory=lambda: SystemOptions(interval_s=0))
    # The member's $TUNEPLANE_OUT_DIR, followed as a whole; None: the telemetry directory only.
    out_dir: Path | None = None
    limits: ScanLimits = attrs.field(factory=ScanLimits)
    # The other coordinators' telemetry gateways, tried in order when ``gateway`` fails
    # (:mod:`.gateway_ring`); () with one coordinator.
    fallbacks: tuple[Gateway, ...] = ()
    # In front of every stream's source id (the dedup identity of its points): "" on a Node;
    # ``restart-<r>/`` in a Slurm job's requeued run, so its points are stored beside the
    # first run's instead of being taken for their duplicates.
    source_prefix: str = ""

    @property
    def member(self) -> tuple[str, int, int]:
        return (self.run_id, self.attempt, self.member_index)

    @property
    def gateways(self) -> tuple[Gateway, ...]:
        """Every gateway the collector may ship to, ``gateway`` first."""
        return (self.gateway, *self.fallbacks)


def followed_root(opts: CollectorOptions) -> tuple[Path, Layout]:
    """The directory the tailer follows and its layout (see the module notes)."""
    if opts.out_dir is None:
        return opts.telemetry_dir, Layout()
    try:
        inner = opts.telemetry_dir.relative_to(opts.out_dir).as_posix()
    except ValueError:
        raise TelemetryPathError(
            f"the telemetry directory {opts.telemetry_dir} is not inside the output directory "
            f"{opts.out_dir}; give --telemetry-dir under --out-dir, or leave --out-dir out"
        ) from None
    if inner == ".":
        raise TelemetryPathError(
            f"the telemetry directory {opts.telemetry_dir} is the output directory itself; "
            "give its telemetry sub-directory as --telemetry-dir"
        )
    body = load_checkpoint(opts.state_dir / CHECKPOINT_FILE)
    if body is not None and body.get("root") == str(opts.telemetry_dir):
        log.info("the checkpoint follows the telemetry directory only; kept so root=%s",
                 opts.telemetry_dir)  # fmt: skip
        return opts.telemetry_dir, Layout()
    return opts.out_dir, Layout.output_dir(inner)
