"""Image runtimes on a Fleet of kind slurm, end to end: a real coordinator, the real `tp`, a real
throwaway Slurm (tests/support/slurm.py), a real ``docker-registry`` on loopback TLS with a test
CA (tests/support/oci_registry.py) and real bubblewrap on the Slurm node.

- A Job whose runtime is a busybox image with a file the host lacks succeeds on a Fleet made with
  ``--image-root`` and ``--registries-file``: the Slurm step pulls the image into the image root
  (with the registry's CA from the registries file) and the member runs in it, so it reads that
  file and the image's own ``/etc/os-release``; `tp logs` shows both. `tp fleet show` shows the
  Fleet's image settings.
- The same image on a Fleet whose registries file lacks the CA cannot be pulled on the node: the
  member fails with the step's sentence, and the Job fails.
(A Fleet without ``--image-root`` refusing an image at Preview: tests/integration/
test_slurm_series.py.)
"""

from __future__ import annotations

import io
import json
import os
import stat
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent.jobs import tp
from tests.faults.jobs import project, submit
from tests.integration.test_slurm_jobs import member, wait_state
from tests.support import rootfs
from tests.support.accounts import require
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.oci_registry import (
    LAYER_TAR,
    PushedImage,
    RegistryProcess,
    start_registry,
    tar_layer,
)
from tests.support.slurm import SlurmCluster, slurm_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BWRAP = Path("/usr/bin/bwrap")
MARKER = Path("/etc/tuneplane-image-marker")
MARKER_TEXT = "this file is only in the test image\n"
TRAIN_SH = f"cat {MARKER}\ncat /etc/os-release\n"


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    with slurm_cluster() as running:
        yield running


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryProcess]:
    with start_registry(tmp_path_factory.mktemp("registry")) as found:
        yield found


def _image(registry: RegistryProcess) -> PushedImage:
    """The busybox root, plus the marker file and a ``/bin/bash`` that runs busybox's sh (the
    custom/custom recipe runs ``bash train.sh``)."""
    bash = b'#!/bin/sh\nexec /bin/sh "$@"\n'
    script = tarfile.TarInfo("bin/bash")
    script.size, script.mode, script.mtime = len(bash), 0o755, 1_700_000_000
    extra = tar_layer([(str(MARKER).lstrip("/"), MARKER_TEXT.encode())], gzipped=False)
    with_bash = _with_file(extra, script, bash)
    busybox = rootfs.layer_tar(rootfs.busybox_root()).read_bytes()
    return registry.push_image(
        "team/busybox", [busybox, with_bash], config={"Env": ["PATH=/bin"]},
        layer_type=LAYER_TAR,
    )  # fmt: skip


def _with_file(layer: bytes, info: tarfile.TarInfo, data: bytes) -> bytes:
    """``layer`` (an uncompressed tar) with one more member."""
    out = io.BytesIO()
    with (
        tarfile.open(fileobj=io.BytesIO(layer)) as source,
        tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for item in source.getmembers():
            tar.addfile(item, source.extractfile(item))
        tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _fleet(
    coord: CoordinatorProcess, cluster: SlurmCluster, name: str, tmp_path: Path, registries: str
) -> Path:
    """A Slurm Fleet ``name`` that runs images; its registries file says ``registries``."""
    shared = tmp_path / f"shared-{name}"
    shared.mkdir()
    token = tmp_path / "slurm.token"
    token.write_text(f"SLURM_JWT={cluster.token()}\n")
    registries_file = tmp_path / f"registries-{name}.toml"
    registries_file.write_text(registries)
    made = coord.admin("fleet", "create", name, "--kind", "slurm", "--slurmrestd",
                       cluster.rest_url, "--token-file", str(token), "--partition",
                       cluster.partition, "--shared-dir", str(shared), "--python",
                       sys.executable, "--image-root", str(tmp_path / "images"),
                       "--registries-file", str(registries_file))  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert f"Images: cached in {tmp_path / 'images'} on each node" in made.stdout
    return shared


def test_a_job_runs_in_its_image_on_a_slurm_node(
    cluster: SlurmCluster, registry: RegistryProcess, tmp_path: Path
) -> None:
    require(BWRAP.exists(), f"bubblewrap ({BWRAP}); install the distribution's bubblewrap")
    assert not MARKER.exists()  # the host lacks the file: only the image has it
    host_release = Path("/etc/os-release").read_text()
    assert "tuneplane-busybox" not in host_release
    image = _image(registry).ref_text(registry.address).removeprefix("image:")
    reached = f'[registries."{registry.address}"]\nca_file = "{registry.ca_file}"\n'
    config = "".join(
        f'\n[fleet.{fleet}.registries."{registry.address}"]\nca_file = "{registry.ca_file}"\n'
        f'\n[profiles.{fleet}]\nseries = "cpu"\nfleet = "{fleet}"\n'
        for fleet in ("hpc", "nocat")
    )
    with start_coordinator(tmp_path, config=config) as coord:
        shared = _fleet(coord, cluster, "hpc", tmp_path, reached)
        shown = json.loads(tp(coord, "fleet", "show", "hpc", "--json"))
        assert shown["slurm"]["image_root"] == str(tmp_path / "images")
        assert shown["slurm"]["registries_file"] == str(tmp_path / "registries-hpc.toml")
        assert "Images: cached in" in tp(coord, "fleet", "show", "hpc")

        root = project(coord, tmp_path / "proj", "custom/custom", {"train.sh": TRAIN_SH})
        run_id = submit(coord, root, "hpc:0", "--image", image)
        wait_state(coord, run_id, "succeeded")
        logs = tp(coord, "logs", run_id)
        assert MARKER_TEXT in logs, logs
        assert rootfs.BUSYBOX_OS_RELEASE in logs, logs  # the image's /, not the host's
        assert (member(shared, run_id) / "stdout.log").read_text() == logs
        # The step cached the image in the job user's own cache under the Fleet's image root.
        mine = tmp_path / "images" / f"uid-{os.getuid()}"
        assert list((mine / "roots").iterdir())
        assert (mine.stat().st_uid, stat.S_IMODE(mine.stat().st_mode)) == (os.getuid(), 0o700)

        # A node that lacks the registry's CA cannot pull it: the member fails with a sentence.
        nocat = _fleet(coord, cluster, "nocat", tmp_path, "")
        (tmp_path / "images").rename(tmp_path / "images-used")  # nothing cached for it
        failed_run = submit(coord, root, "nocat:0", "--image", image)
        failed = wait_state(coord, failed_run, "failed")
        said = "".join(p.read_text() for p in (nocat / failed_run).rglob("slurm-*.out"))
        assert "cannot be had on this node" in said, (failed, said)
