"""A Fleet of kind slurm's partition as ``tp fleet show`` shows it: asked of slurmrestd now.

Rules: this never raises for what slurmrestd or the token file did: a failure becomes the
view's ``error`` sentence, so ``tp fleet show`` still shows the Fleet's own facts. A deadline
bounds the whole question (discovery, ping, partition, nodes).
"""

from __future__ import annotations

import anyio

from tuneplane.coordinator.values.fleet import SlurmPartition, SlurmPartitionNode, SlurmSettings

from ._errors import SlurmError
from ._settings import SlurmSettingsError, probe_settings

VIEW_TIMEOUT_S = 10.0


async def partition_view(
    settings: SlurmSettings, timeout_s: float = VIEW_TIMEOUT_S
) -> SlurmPartition:
    """The partition's nodes and GPUs as slurmrestd reports them, or why they cannot be read."""
    error = ""
    nodes: tuple[SlurmPartitionNode, ...] = ()
    try:
        with anyio.fail_after(timeout_s):
            found = await probe_settings(settings)
        nodes = tuple(
            SlurmPartitionNode(n.name, n.state, n.cpus, n.gpus, n.gpus_used, n.gres) for n in found
        )
    except (SlurmError, SlurmSettingsError) as exc:
        error = str(exc)
    except TimeoutError:
        error = (
            f"slurmrestd at {settings.slurmrestd} did not report partition "
            f"{settings.partition!r} within {timeout_s:g} s; check that it and slurmctld run."
        )
    return SlurmPartition(
        settings.slurmrestd, settings.partition, nodes, error, settings.series,
        settings.image_root, settings.registries_file,
    )  # fmt: skip
