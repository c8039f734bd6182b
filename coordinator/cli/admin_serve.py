"""``tuneplane-coordinator serve``: serve from a state directory ``init`` made (admin_init).

Rules: ``serve`` refuses a heartbeat
timeout no longer than the interval, since every Node would then look dead.
"""

from __future__ import annotations

from pathlib import Path

import click

from ..server import gc_settings
from ..server.serve import (
    DEFAULT_API_PORT,
    DEFAULT_CONTROL_PORT,
    DEFAULT_TELEMETRY_PORT,
    ServeOptions,
    serve,
)
from .admin_common import run, state_dir_option, store_option


@click.command(name="serve")
@state_dir_option
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on (0.0.0.0 or :: for every address; then set --advertise).",
)
@click.option(
    "--advertise",
    default="",
    help="Name or address other machines dial to reach every listener; it is what serve hands "
    "out (endpoints.json, tp-context.json, the telemetry address Nodes get). Overrides "
    "[addresses] host in coordinator.toml; default: the --host address.",
)
@click.option(
    "--api-port",
    default=DEFAULT_API_PORT,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="API port (0: pick a free one).",
)
@click.option(
    "--control-port",
    default=DEFAULT_CONTROL_PORT,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="Control gateway port, the address Nodes enroll with (0: pick a free one).",
)
@click.option(
    "--telemetry-port",
    default=DEFAULT_TELEMETRY_PORT,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="Telemetry gateway port (0: pick a free one).",
)
@click.option(
    "--heartbeat-interval",
    default=5.0,
    show_default=True,
    type=click.FloatRange(min=0.05),
    help="Seconds between a Node's heartbeats.",
)
@click.option(
    "--heartbeat-timeout",
    default=15.0,
    show_default=True,
    type=click.FloatRange(min=0.1),
    help="Seconds of silence after which a Node's control stream is closed.",
)
@click.option(
    "--prepare-timeout",
    default=120.0,
    show_default=True,
    type=click.FloatRange(min=0.1),
    help="Seconds every member has to be prepared before the launch is aborted.",
)
@click.option(
    "--store",
    "store_url",
    default=None,
    metavar="URL",
    help="Use this PostgreSQL database for this run, over [store] url in coordinator.toml.",
)
def serve_command(
    state_dir: Path,
    host: str,
    advertise: str,
    api_port: int,
    control_port: int,
    telemetry_port: int,
    heartbeat_interval: float,
    heartbeat_timeout: float,
    prepare_timeout: float,
    store_url: str | None,
) -> None:
    """Serve the API, control and telemetry listeners until SIGTERM or SIGINT."""
    url = store_option(store_url)
    if heartbeat_timeout <= heartbeat_interval:
        raise click.BadParameter(
            f"--heartbeat-timeout ({heartbeat_timeout:g}) must be longer than "
            f"--heartbeat-interval ({heartbeat_interval:g}), or every Node looks dead.",
            param_hint="--heartbeat-timeout",
        )
    gc_settings.apply()
    run(
        serve,
        ServeOptions(
            state_dir=state_dir,
            host=host,
            advertise=advertise,
            api_port=api_port,
            control_port=control_port,
            telemetry_port=telemetry_port,
            heartbeat_interval_s=heartbeat_interval,
            heartbeat_timeout_s=heartbeat_timeout,
            prepare_timeout_s=prepare_timeout,
            store_url=url,
        ),
    )
