"""Series on a Fleet of kind slurm, against the real throwaway Slurm (tests/support/slurm.py),
whose node has GPUs of the gpu GRES type ``h200`` and the node feature ``tpnode``.

- A Fleet mapping ``h200=gres:gpu:h200`` and ``cpu=constraint:tpnode`` runs a Job of each: the
  Slurm job asks for the typed GRES (or the feature) and lands; `tp fleet show` lists the
  mappings.
- A Series mapped to what the cluster lacks (``h100=gres:gpu:h100``) is refused by slurmctld
  at submit, and the Job fails with Slurm's words.
- A Series the Fleet does not map is refused at Preview with a sentence naming the Series, and
  so is an image runtime on a Fleet made without --image-root (nothing submitted to Slurm;
  images on a Fleet made with it: tests/integration/test_slurm_images.py).
- A malformed ``--series`` is refused with a sentence naming the flag, and no Fleet is made.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent.jobs import tp
from tests.cli.tp_process import run_tp_as
from tests.faults.jobs import project, submit
from tests.integration.test_slurm_jobs import member, submitted, wait_state
from tests.support.coordinator import start_coordinator
from tests.support.slurm import SlurmCluster, slurm_cluster
from tuneplane.coordinator.demo.slurm import FEATURE, GPU_TYPE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# The Fleet lists a registry, so an image from it passes the registry check and meets the
# Slurm Fleet's own refusal (nothing listens at port 9: no pull is ever tried).
REGISTRY = '\n[fleet.hpc.registries."127.0.0.1:9"]\n'
PROFILES = REGISTRY + "\n[series.b200]\ncards = 0\naccelerator = true\n" + "".join(
    f'\n[profiles.{name}]\nseries = "{series}"\nfleet = "hpc"\n'
    for name, series in (("hpc", "h200"), ("hpc-cpu", "cpu"), ("hpc-h100", "h100"),
                         ("hpc-b200", "b200"))
)  # fmt: skip
SERIES = (f"h200=gres:gpu:{GPU_TYPE}", f"cpu=constraint:{FEATURE}", "h100=gres:gpu:h100")


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    with slurm_cluster() as running:
        yield running


def _show_job(cluster: SlurmCluster, job_id: int) -> str:
    return cluster.client("scontrol", "show", "job", str(job_id))


def test_series_are_asked_as_their_gres_type_or_node_feature(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    token = tmp_path / "slurm.token"
    token.write_text(f"SLURM_JWT={cluster.token()}\n")
    with start_coordinator(tmp_path, config=PROFILES) as coord:
        fleet = ["fleet", "create", "hpc", "--kind", "slurm", "--slurmrestd", cluster.rest_url,
                 "--token-file", str(token), "--partition", cluster.partition, "--shared-dir",
                 str(shared), "--python", sys.executable]  # fmt: skip
        bad = coord.admin(*fleet, "--series", "h200=gpu:h200")
        assert bad.returncode != 0
        assert "--series 'h200=gpu:h200' maps to neither gres: nor constraint:" in bad.stderr
        series = [arg for s in SERIES for arg in ("--series", s)]
        made = coord.admin(*fleet, *series)
        assert made.returncode == 0, made.stderr
        assert f"Series h200: gres gpu:{GPU_TYPE}." in made.stdout

        shown = json.loads(tp(coord, "fleet", "show", "hpc", "--json"))
        assert shown["slurm"]["series"] == [
            {"series": "cpu", "gres_type": "", "constraint": FEATURE},
            {"series": "h100", "gres_type": "h100", "constraint": ""},
            {"series": "h200", "gres_type": GPU_TYPE, "constraint": ""},
        ]
        assert "CONSTRAINT" in tp(coord, "fleet", "show", "hpc")

        root = project(coord, tmp_path / "proj", "custom/custom",
                       {"train.sh": 'echo "GPUs $CUDA_VISIBLE_DEVICES"\n'})  # fmt: skip
        gpu_run = submit(coord, root, "hpc:2")
        cpu_run = submit(coord, root, "hpc-cpu:0")
        wait_state(coord, gpu_run, "succeeded")
        wait_state(coord, cpu_run, "succeeded")
        assert (member(shared, gpu_run) / "stdout.log").read_text() == "GPUs 0,1\n"
        [gpu_job] = submitted(coord, gpu_run)
        assert f"gpu:{GPU_TYPE}:2" in _show_job(cluster, gpu_job["detail"]["slurm_job_id"])
        [cpu_job] = submitted(coord, cpu_run)
        assert f"Features={FEATURE}" in _show_job(cluster, cpu_job["detail"]["slurm_job_id"])

        lacking = submit(coord, root, "hpc-h100:1")
        failed = wait_state(coord, lacking, "failed")
        assert "Slurm refused to submit the job" in failed["state_reason"], failed

        refused = run_tp_as(coord, None, "submit", "job", "--profile", "hpc-b200:1", "--yes",
                            cwd=root)  # fmt: skip
        assert refused.returncode != 0
        assert "asks for the Series 'b200', which the Fleet 'hpc' (kind slurm) does not map" in (
            refused.stderr
        ), refused.stderr

        # An image runtime is refused at Preview on a Fleet made without --image-root, before
        # any registry is asked, never run with the node's own interpreter instead; nothing is
        # queued and nothing is submitted to Slurm.
        jobs_before = json.loads(tp(coord, "job", "ls", "--json"))
        slurm_before = cluster.client("squeue", "-h", "-t", "all", "-o", "%i").split()
        imaged = run_tp_as(coord, None, "submit", "job", "--profile", "hpc:1", "--image",
                           f"127.0.0.1:9/team/app@sha256:{'a' * 64}", "--yes",
                           cwd=root)  # fmt: skip
        assert imaged.returncode != 0
        assert "the Fleet 'hpc' (kind slurm) has no image root to cache images in" in (
            imaged.stderr
        ), imaged.stderr
        assert "--image-root" in imaged.stderr, imaged.stderr
        assert json.loads(tp(coord, "job", "ls", "--json")) == jobs_before
        assert cluster.client("squeue", "-h", "-t", "all", "-o", "%i").split() == slurm_before
