"""The throwaway Slurm cluster (tuneplane.coordinator.demo.slurm) as tests use it: skipped with
a sentence when this machine cannot run it, failed instead under ``CI=true`` (CI must run these
tests), and every daemon handed to the tests' last-resort reaper."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from tests.support.accounts import require
from tests.support.processes import track, untrack
from tuneplane.coordinator.demo.slurm import GPUS_PER_NODE as GPUS_PER_NODE
from tuneplane.coordinator.demo.slurm import SlurmCluster as SlurmCluster
from tuneplane.coordinator.demo.slurm import SlurmHost as SlurmHost
from tuneplane.coordinator.demo.slurm import missing
from tuneplane.coordinator.demo.slurm import slurm_cluster as _slurm_cluster


def require_slurm() -> None:
    """Skip (fail under CI=true) unless this machine can run the throwaway cluster."""
    lacking = missing()
    require(lacking is None, lacking or "")


@contextmanager
def slurm_cluster(
    controller: SlurmHost | None = None, nodes: Sequence[SlurmHost] = ()
) -> Iterator[SlurmCluster]:
    """The cluster: this machine as controller and only node, unless ``controller`` and
    ``nodes`` are hosts of their own (tests/integration/test_slurm_nodes.py)."""
    require_slurm()
    with _slurm_cluster(track, untrack, controller=controller, nodes=nodes) as cluster:
        yield cluster
