"""``tuneplane-coordinator fleet create --kind slurm`` against a real slurmrestd: a Fleet is
stored (with its settings, in the decision log) only after slurmrestd answered with the
partition; every wrong setting is refused with a sentence and stores nothing."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.coordinator import admin_argv
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
