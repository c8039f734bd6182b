"""The real ``tp`` against a real coordinator over loopback TLS: preview, commit, jobs, refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cli.tp_process import run_tp
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tuneplane.coordinator.catalogue import Catalogue
from tuneplane.coordinator.cli.project import init_project
from tuneplane.coordinator.cli.scaffold import new_experiment


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    with start_coordinator(tmp_path_factory.mktemp("coord")) as coord:
        yield coord


@pytest.fixture
def project(tmp_path: Path) -> Path:
    made = init_project(tmp_path / "proj", "clitest")
    new_experiment(made, "hello", "custom/custom", Catalogue.bundled())
    new_experiment(made, "ar", "pytorch/process-group", Catalogue.bundled())
    return made.root


def _env(coordinator: CoordinatorProcess) -> dict[str, str]:
    return {"TUNEPLANE_CONTEXT": str(coordinator.context_path)}


def _tp(coordinator: CoordinatorProcess, project: Path, *args: str) -> Any:
    return run_tp(*args, cwd=project, env=_env(coordinator))


def _lines(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def _preview(coordinator: CoordinatorProcess, project: Path, *extra: str) -> dict[str, Any]:
    done = _tp(coordinator, project, "submit", "hello", "--profile", "h200:1", "--preview",
               "--json", *extra)  # fmt: skip
    assert done.returncode == 0, done.stderr
    (line,) = _lines(done.stdout)
    assert line["kind"] == "preview"
    return line


def test_preview_writes_the_file_and_creates_no_job(
    coordinator: CoordinatorProcess, project: Path
) -> None:
    line = _preview(coordinator, project)
    path = project / ".tuneplane-data" / "submissions" / f"{line['preview_id']}.json"
    assert Path(line["file"]) == path
    saved = json.loads(path.read_text())
    assert saved["preview"]["preview_id"] == line["preview_id"]
    assert saved["preview"]["digest"] == line["digest"]
    assert line["digest"].startswith("sha256:")
    assert saved["coordinator"] == coordinator.api
    assert saved["retry_key"].startswith("rk-")
    assert saved["receipt"] is None
    assert line["summary"]["series"] == "h200"
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    listed = json.loads(_tp(coordinator, project, "job", "ls", "--json").stdout)
    assert [job for job in listed if job["preview_id"] == line["preview_id"]] == []
    human = _tp(coordinator, project, "submit", "hello", "--profile", "h200:1", "--preview")
    assert human.returncode == 0, human.stderr
    assert "Fleet" in human.stdout and "tp submit --commit pv" in human.stdout


def test_commit_twice_gives_the_same_run_id(coordinator: CoordinatorProcess, project: Path) -> None:
    line = _preview(coordinator, project)
    path = Path(line["file"])
    retry_key = json.loads(path.read_text())["retry_key"]
    first = _tp(coordinator, project, "submit", "--commit", line["preview_id"], "--json")
    assert first.returncode == 0, first.stderr
    (receipt,) = _lines(first.stdout)
    assert receipt["kind"] == "receipt" and receipt["created"] is True
    assert receipt["run_id"].startswith("run-")
    assert receipt["retry_key"] == retry_key
    # The file path works as well as the id, from anywhere; the same key is sent again.
    second = run_tp("submit", "--commit", str(path), cwd=project.parent, env=_env(coordinator))
    assert second.returncode == 0, second.stderr
    assert f"Job {receipt['run_id']} already admitted" in second.stdout
    saved = json.loads(path.read_text())
    assert saved["retry_key"] == retry_key
    assert saved["receipt"]["run_id"] == receipt["run_id"]


def test_yes_then_job_ls_and_show(coordinator: CoordinatorProcess, project: Path) -> None:
    done = _tp(coordinator, project, "submit", "ar", "--profile", "h200:2", "--members", "2",
               "--param", "steps=3", "--yes", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    preview, receipt = _lines(done.stdout)
    assert preview["kind"] == "preview" and receipt["kind"] == "receipt"
    assert preview["summary"]["members"] == 2 and preview["summary"]["gpus_per_member"] == 1
    run_id = receipt["run_id"]

    listed = json.loads(_tp(coordinator, project, "job", "ls", "--json").stdout)
    mine = [job for job in listed if job["run_id"] == run_id]
    assert len(mine) == 1
    assert (mine[0]["project"], mine[0]["experiment"]) == ("clitest", "ar")

    shown = _tp(coordinator, project, "job", "show", run_id, "--json")
    assert shown.returncode == 0, shown.stderr
    job = json.loads(shown.stdout)
    assert job["run_id"] == run_id
    assert job["method_id"] == "pytorch/process-group"
    assert job["preview_id"] == preview["preview_id"] and job["digest"] == preview["digest"]
    assert job["history"] and job["history"][0]["state"] == job["state"] == "queued"
    human = _tp(coordinator, project, "job", "show", run_id)
    assert human.returncode == 0, human.stderr
    assert f"Job         {run_id}" in human.stdout and "State history" in human.stdout
    table = _tp(coordinator, project, "job", "ls", "--project", "clitest")
    assert run_id in table.stdout


def test_server_refusals_exit_1_with_its_sentence(
    coordinator: CoordinatorProcess, project: Path
) -> None:
    unknown = _tp(coordinator, project, "job", "show", "run-doesnotexist")
    assert unknown.returncode == 1
    assert "run-doesnotexist" in unknown.stderr and "Traceback" not in unknown.stderr
    profile = _tp(coordinator, project, "submit", "hello", "--profile", "nope:1", "--preview")
    assert profile.returncode == 1
    assert "resources.profile" in profile.stderr and "not a Profile" in profile.stderr
    assert not (project / ".tuneplane-data").exists()


def test_a_wrong_token_is_refused(
    coordinator: CoordinatorProcess, project: Path, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("not-the-token\n")
    done = _tp(coordinator, project, "--token-file", str(token), "job", "ls")
    assert done.returncode == 1
    assert done.stderr.startswith("error: ") and "Traceback" not in done.stderr


def test_a_wrong_ca_is_refused_with_a_clear_message(
    coordinator: CoordinatorProcess, project: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other-coordinator"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tuneplane.coordinator.cli.admin",
            "init",
            "--state-dir",
            str(other),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    wrong_ca = other / "tls" / "ca.pem"
    done = _tp(coordinator, project, "--ca", str(wrong_ca), "job", "ls")
    assert done.returncode == 1
    assert f"TLS verification of the coordinator at {coordinator.api} failed" in done.stderr
    assert f"not signed by the CA in {wrong_ca}" in done.stderr


def test_commit_against_another_coordinator_is_refused(
    coordinator: CoordinatorProcess, project: Path
) -> None:
    line = _preview(coordinator, project)
    port = coordinator.api.rpartition(":")[2]
    elsewhere = f"localhost:{port}"
    done = _tp(coordinator, project, "--coordinator", elsewhere, "submit", "--commit",
               line["preview_id"])  # fmt: skip
    assert done.returncode == 1
    assert f"made by the coordinator at {coordinator.api}" in done.stderr
    assert f"configured for {elsewhere}" in done.stderr
    assert os.path.exists(line["file"])
