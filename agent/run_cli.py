"""``tuneplane-node run``: run the agent until SIGTERM/SIGINT, which leave every member running.

Rules: everything that can refuse a start (the state dir, the workload policy, the outputs
listener's port) is checked before the journal is opened, so a refused start changes nothing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click
import trio

from tuneplane.collector.defaults import DEFAULT_MAX_FILES, SYSTEM_INTERVAL_S

from . import config as node_config
from . import daemon_log, outputs_identity, outputs_server, workload_checks
from .cli_gpu_source import gpu_source, one_gpu_source, scripted_nvml_option
from .cli_settings import (
    images_settings,
    metrics_listener,
    outputs_settings,
    registries,
    workload_policy,
)
from .cli_support import sentences, state_dir_option
from .daemon import Daemon, run_daemon
from .daemon_base import INVENTORY_INTERVAL_S
from .daemon_status import Status
from .image_store import default_image_root
from .inventory_source import PROBE_LIMIT_S, RELEASE_REQUEST
from .metrics_listener import MetricsListener
from .sd_notify import ServiceNotifier
from .state_dir import StateDir


@contextmanager
def _metrics_served(listener: MetricsListener | None, status: Status) -> Iterator[str]:
    """The Node's metrics served for the ``with`` block; yields the listener's address, ""
    when node.toml has no [metrics]. Only then does agent/metrics.py (prometheus_client, with
    http.server, urllib.request and wsgiref) load: the idle agent's memory (issue 13, goal 4)."""
    if listener is None:
        yield ""
        return
    from . import metrics as node_metrics

    with node_metrics.serving(listener, status) as address:
        yield address


def _setup_logging(level: str) -> None:
    daemon_log.configure(
        getattr(logging, level.upper()),
        "tuneplane-node",
        "%(asctime)s %(levelname)s %(name)s %(message)s",
    )


@click.command("run")
@state_dir_option
@click.option("--simulate-gpus", default=None, help="Report N simulated GPUs of SERIES (h200:2).")
@scripted_nvml_option
@click.option(
    "--out-root",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where $TUNEPLANE_OUT_DIR of every member lives, outside the state dir (default: "
    "tuneplane-outputs beside the state dir).",
)
@click.option(
    "--work-root",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where members' work directories live, outside the state dir (default: "
    "tuneplane-work beside the state dir).",
)
@click.option(
    "--image-root",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where runtime images are cached and unpacked, outside the state dir so members' "
    "sandboxes can reach their image (default: tuneplane-images beside the state dir).",
)
@click.option("--log-level", default="info", type=click.Choice(["debug", "info", "warning"]))
@click.option(
    "--inventory-interval",
    "inventory_interval_s",
    type=click.FloatRange(min=0.1, max=3600),
    default=INVENTORY_INTERVAL_S,
    show_default=True,
    help="Seconds between GPU probes; also how soon a `tuneplane-node gpu clear` takes effect.",
)
@click.option(
    "--probe-limit",
    "probe_limit_s",
    type=click.FloatRange(min=0.1, max=600),
    default=PROBE_LIMIT_S,
    show_default=True,
    help="Seconds one GPU probe may take; a longer one is abandoned and the GPUs read "
    '"NVML unresponsive".',
)
@click.option(
    "--system-interval",
    "system_interval_s",
    type=click.FloatRange(min=0, max=3600),
    default=SYSTEM_INTERVAL_S,
    show_default=True,
    help="Seconds between samples of each member's GPUs and processes (system/... series); "
    "0 turns them off. node.toml: [telemetry] system_interval_s.",
)
@click.option(
    "--telemetry-max-files",
    "telemetry_max_files",
    type=click.IntRange(min=1, max=node_config.MAX_TELEMETRY_FILES),
    default=DEFAULT_MAX_FILES,
    show_default=True,
    help="The most telemetry files one member's collector follows at once; more are reported "
    "(tp job show), not read. node.toml: [telemetry] max_files.",
)
def run_command(
    state_dir: Path,
    simulate_gpus: str | None,
    scripted_nvml: Path | None,
    out_root: Path | None,
    work_root: Path | None,
    image_root: Path | None,
    log_level: str,
    inventory_interval_s: float,
    probe_limit_s: float,
    system_interval_s: float,
    telemetry_max_files: int,
) -> None:
    """Run the agent until SIGTERM/SIGINT (which stop it and leave every member running)."""
    _setup_logging(log_level)
    # Taken out of the environment before anything is started: no runner, collector or
    # workload may talk to systemd as the agent.
    notifier = ServiceNotifier.from_environment()
    one_gpu_source(simulate_gpus, scripted_nvml)
    if not state_dir.is_absolute():
        # Every runner the agent starts works from its own directory and finds its member by the
        # paths the journal holds: a relative one would point somewhere else there.
        raise click.UsageError(
            f"--state-dir {state_dir} is a relative path, but the agent and the runners it "
            "starts must find it from any working directory. Pass an absolute path, for "
            f"example --state-dir {state_dir.absolute()}."
        )
    state = StateDir(state_dir)
    with sentences():
        node = state.load_node()
        credential = state.read_credential()
        state.create()
        outputs = (out_root or workload_checks.default_out_root(state.root)).resolve()
        works = (work_root or workload_checks.default_work_root(state.root)).resolve()
        images = (image_root or default_image_root(state.root)).resolve()
        policy = workload_policy()
        reached = registries()
        image_max_bytes = images_settings()
        refused = workload_checks.start_problems(policy, state.root, works, outputs, images)
        if refused:
            raise click.ClickException(" ".join(refused))
        for warning in workload_checks.warnings(policy):
            logging.getLogger(__name__).warning("workload policy warning=%s", warning)
        # Members must be able to pass through the roots to their own 0700 directories.
        for root in (outputs, works):
            root.mkdir(mode=0o711, parents=True, exist_ok=True)
        source = gpu_source(
            node.name, simulate_gpus, scripted_nvml, state.root / RELEASE_REQUEST, probe_limit_s
        )
        # Bound before the journal is opened: a taken port stops the agent with nothing changed.
        served, toml = outputs_settings()
        bound = None
        if served.on:
            identity = outputs_identity.load_or_create(state.credentials_dir, node.node_id)
            try:
                bound = outputs_server.bind(served, identity, toml)
            except outputs_server.OutputsListenFailed as exc:
                raise click.ClickException(str(exc)) from None
        daemon = Daemon(
            state, node, credential, source, outputs, work_root=works, image_root=images,
            policy=policy,
            inventory_interval_s=inventory_interval_s, system_interval_s=system_interval_s,
            telemetry_max_files=telemetry_max_files, outputs=bound, registries=reached,
            image_max_bytes=image_max_bytes,
        )  # fmt: skip
        logging.getLogger(__name__).info(
            "agent starting node_id=%s coordinator=%s gpus=%d gpu_source=%s pid=%d",
            node.node_id, node.coordinator, len(daemon.inventory.gpus),
            daemon.inventory.gpu_source, os.getpid(),
        )  # fmt: skip
        # Bound before the journal is opened: a taken port stops the agent with nothing changed.
        with _metrics_served(metrics_listener(), daemon.status) as metrics_address:
            daemon.status.metrics_address = metrics_address
            trio.run(run_daemon, daemon, notifier)
