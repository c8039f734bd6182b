"""``tuneplane-coordinator fleet create --kind slurm`` and ``tp fleet show`` against a real
slurmrestd: a Fleet is stored (with its settings, in the decision log) only after slurmrestd
answered with the partition; every wrong setting is refused with a sentence and stores nothing;
``tp fleet show`` lists the partition's nodes and GPUs, or says why it could not; a Preview for
a Slurm Fleet with no shared folder (one created before it existed) is refused, since nothing
could run its Jobs."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from grpclib import GRPCError
from grpclib.const import Status

from tests.cli.tp_process import run_tp_as
from tests.coordinator.grpc_client import api_client, jobspec
from tests.support.coordinator import admin_argv, start_coordinator
from tests.support.slurm import GPUS_PER_NODE, SlurmCluster, slurm_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    with slurm_cluster() as running:
        yield running


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    where = tmp_path / "coordinator"
    subprocess.run(admin_argv("init", "--state-dir", str(where)), check=True,
                   capture_output=True, timeout=60)  # fmt: skip
    return where


@pytest.fixture
def token_file(cluster: SlurmCluster, tmp_path: Path) -> Path:
    path = tmp_path / "slurm.token"
    path.write_text(f"SLURM_JWT={cluster.token()}\n")  # as `scontrol token` prints it
    return path


def admin(state_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(admin_argv(*args, "--state-dir", str(state_dir)),
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def fleets(state_dir: Path) -> dict[str, str]:
    listed = admin(state_dir, "fleet", "ls", "--json")
    assert listed.returncode == 0, listed.stderr
    return {f["name"]: f["kind"] for f in json.loads(listed.stdout)}


def created_decisions(state_dir: Path) -> list[dict[str, object]]:
    out = admin(state_dir, "decisions", "--json")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    return [r for r in rows if r["kind"] == "fleet created"]


def create(state_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return admin(state_dir, "fleet", "create", *args)


def test_a_slurm_fleet_is_created_after_slurmrestd_shows_its_partition(
    cluster: SlurmCluster, state_dir: Path, token_file: Path
) -> None:
    made = create(state_dir, "hpc", "--kind", "slurm", "--slurmrestd", cluster.rest_url,
                  "--token-file", str(token_file), "--partition", cluster.partition)  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == (
        f"Created Fleet hpc (kind slurm): partition {cluster.partition} on {cluster.rest_url}, "
        f"1 node, {GPUS_PER_NODE} GPUs."
    )
    assert fleets(state_dir) == {"default": "node", "hpc": "slurm"}
    [decision] = [d for d in created_decisions(state_dir) if "hpc" in json.dumps(d)]
    assert json.dumps(decision).count(str(token_file)) == 1
    again = create(state_dir, "hpc", "--kind", "slurm", "--slurmrestd", cluster.rest_url,
                   "--token-file", str(token_file), "--partition", cluster.partition)  # fmt: skip
    assert again.returncode != 0 and "already exists" in again.stderr


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"--partition": "gpu-nope"}, "Slurm refused to report partition 'gpu-nope'"),
        ({"--partition": "bad name"}, "is not a Slurm partition name"),
        ({"--slurmrestd": "ftp://127.0.0.1:1"}, "is not a slurmrestd URL"),
        ({"--slurmrestd": "http://127.0.0.1:1"}, "did not answer"),
        ({"--token-file": "/nonexistent/slurm.token"}, "cannot be read"),
        ({"--shared-dir": "relative/dir"}, "--shared-dir 'relative/dir' is not an absolute path"),
        ({"--shared-dir": "/nonexistent/shared"}, "is not a folder on the coordinator's machine"),
        ({"--python": "python3 -X"}, "--python 'python3 -X' is not an interpreter"),
    ],
)
def test_a_wrong_setting_is_refused_with_a_sentence_and_stores_nothing(
    cluster: SlurmCluster, state_dir: Path, token_file: Path, change: dict[str, str], says: str
) -> None:
    flags = {"--slurmrestd": cluster.rest_url, "--token-file": str(token_file),
             "--partition": cluster.partition, **change}  # fmt: skip
    made = create(state_dir, "hpc", "--kind", "slurm", *(x for kv in flags.items() for x in kv))
    assert made.returncode != 0
    assert says in made.stderr, made.stderr
    assert fleets(state_dir) == {"default": "node"}


def test_a_token_file_without_a_jwt_is_refused(
    cluster: SlurmCluster, state_dir: Path, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.token"
    bad.write_text("not-a-token\n")
    made = create(state_dir, "hpc", "--kind", "slurm", "--slurmrestd", cluster.rest_url,
                  "--token-file", str(bad), "--partition", cluster.partition)  # fmt: skip
    assert (
        made.returncode != 0 and "is not a JWT" in made.stderr and "scontrol token" in made.stderr
    )
    assert fleets(state_dir) == {"default": "node"}


def test_slurm_settings_need_kind_slurm_and_kind_slurm_needs_them_all(state_dir: Path) -> None:
    stray = create(state_dir, "x", "--partition", "tp")
    assert stray.returncode != 0 and "--partition describes a Fleet of kind slurm" in stray.stderr
    short = create(state_dir, "x", "--kind", "slurm", "--partition", "tp")
    assert short.returncode != 0
    assert "needs --slurmrestd, --token-file" in short.stderr
    assert fleets(state_dir) == {"default": "node"}


def test_tp_fleet_show_lists_the_partitions_nodes_and_gpus_as_slurmrestd_reports_them(
    cluster: SlurmCluster, tmp_path: Path, token_file: Path
) -> None:
    with start_coordinator(tmp_path) as coord:
        made = coord.admin("fleet", "create", "hpc", "--kind", "slurm", "--slurmrestd",
                           cluster.rest_url, "--token-file", str(token_file), "--partition",
                           cluster.partition)  # fmt: skip
        assert made.returncode == 0, made.stderr
        shown = run_tp_as(coord, None, "fleet", "show", "hpc", "--json")
        assert shown.returncode == 0, shown.stderr
        fleet = json.loads(shown.stdout)
        assert fleet["kind"] == "slurm"
        assert fleet["slurm"]["partition"] == cluster.partition
        assert fleet["slurm"]["slurmrestd"] == cluster.rest_url and fleet["slurm"]["error"] == ""
        [node] = fleet["slurm"]["nodes"]
        assert (node["name"], node["gpus"], node["gpus_used"]) == (cluster.host, GPUS_PER_NODE, 0)
        text = run_tp_as(coord, None, "fleet", "show", "hpc")
        assert text.returncode == 0, text.stderr
        assert f"Slurm partition {cluster.partition}" in text.stdout and cluster.host in text.stdout
        # No Node enrolls into a Slurm Fleet, so it shows no Nodes or GPUs of its own.
        assert "enrolled" not in text.stdout and "GPUs per Series" not in text.stdout
        # A Fleet of Nodes says nothing about Slurm.
        default = json.loads(run_tp_as(coord, None, "fleet", "show", "default", "--json").stdout)
        assert default["slurm"] is None

        # slurmrestd gone: the Fleet is still shown, with a sentence instead of the nodes.
        cluster.stop_rest()
        try:
            down = run_tp_as(coord, None, "fleet", "show", "hpc", "--json")
        finally:
            cluster.start_rest()
        assert down.returncode == 0, down.stderr
        slurm = json.loads(down.stdout)["slurm"]
        assert slurm["nodes"] == [] and "did not answer" in slurm["error"]
        assert slurm["error"].endswith(".")


def test_a_preview_for_a_slurm_fleet_without_a_shared_folder_is_refused_not_queued(
    cluster: SlurmCluster, tmp_path: Path, token_file: Path
) -> None:
    profile = '\n[profiles.hpc-cpu]\nseries = "cpu"\nfleet = "hpc"\n'
    with start_coordinator(tmp_path, config=profile) as coord:
        made = coord.admin("fleet", "create", "hpc", "--kind", "slurm", "--slurmrestd",
                           cluster.rest_url, "--token-file", str(token_file), "--partition",
                           cluster.partition)  # fmt: skip
        assert made.returncode == 0, made.stderr

        async def preview() -> None:
            async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
                await api.preview(jobspec(gpus=0, profile="hpc-cpu"))

        with pytest.raises(GRPCError) as caught:
            asyncio.run(preview())
        assert caught.value.status == Status.INVALID_ARGUMENT
        assert "of kind slurm, which has no shared folder" in str(caught.value.message)
        assert "--shared-dir" in str(caught.value.message)
        listed = run_tp_as(coord, None, "job", "ls", "--json")
        assert listed.returncode == 0 and json.loads(listed.stdout) == []
