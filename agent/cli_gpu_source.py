"""The GPU source options (``--simulate-gpus``, ``--scripted-nvml``) as one InventorySource.

Rules: a command reads its GPUs from exactly the one source its options name; both options
together are a usage error, and a bad ``--simulate-gpus`` is a bad parameter that says the fix.
"""

from __future__ import annotations

from pathlib import Path

import click

from .inventory import InventoryError, SimulatedGpus, parse_simulate_gpus
from .inventory_source import PROBE_LIMIT_S, InventorySource

scripted_nvml_option = click.option(
    "--scripted-nvml",
    "scripted_nvml",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Read the GPUs from the scripted NVML test double driven by FILE (format in "
    "agent/scripted_nvml.py) instead of the real driver; not with --simulate-gpus.",
)


def gpu_source(
    node_name: str,
    simulate_gpus: str | None,
    scripted_nvml: Path | None,
    release_request: Path | None = None,
    limit_s: float = PROBE_LIMIT_S,
) -> InventorySource:
    """The one GPU source the options name; a usage error for two of them."""
    one_gpu_source(simulate_gpus, scripted_nvml)
    return InventorySource(
        node_name, _simulate(simulate_gpus), scripted_nvml, release_request, limit_s
    )


def one_gpu_source(simulate_gpus: str | None, scripted_nvml: Path | None) -> None:
    """A usage error when both GPU source options are given."""
    if simulate_gpus is not None and scripted_nvml is not None:
        raise click.UsageError(
            "--simulate-gpus and --scripted-nvml cannot be used together; pass one of them."
        )


def _simulate(value: str | None) -> SimulatedGpus | None:
    if value is None:
        return None
    try:
        return parse_simulate_gpus(value)
    except InventoryError as exc:
        raise click.BadParameter(str(exc)) from None
