"""The real ``tp`` process, no coordinator: project commands, exit codes, connection errors."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.tp_process import run_tp
from tuneplane.coordinator.catalogue import Catalogue
from tuneplane.coordinator.cli.project import init_project
from tuneplane.coordinator.cli.scaffold import new_experiment


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project made by the library tp uses (one process start per test is enough)."""
    made = init_project(tmp_path / "proj", "demo")
    new_experiment(made, "hello", "custom/custom", Catalogue.bundled())
    return made.root


def test_init_new_and_their_files(tmp_path: Path) -> None:
    project = tmp_path / "proj"
    done = run_tp("init", str(project), "--name", "demo", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Initialised project demo" in done.stdout
    done = run_tp("new", "hello", "--method", "custom/custom", cwd=project)
    assert done.returncode == 0, done.stderr
    assert "wrote experiments/hello/train.sh" in done.stdout
    assert (project / "tuneplane.yaml").read_text().endswith("name: demo\n")
    files = sorted(p.name for p in (project / "experiments" / "hello").iterdir())
    assert files == ["config.yaml", "recipe.lock.json", "train.sh"]
    again = run_tp("init", str(project), cwd=project)
    assert again.returncode == 1
    assert "already exists" in again.stderr


def test_new_outside_a_project_names_tp_init(tmp_path: Path) -> None:
    done = run_tp("new", "x", "--method", "custom/custom", cwd=tmp_path)
    assert done.returncode == 1
    assert "Run `tp init`" in done.stderr
    assert not (tmp_path / "experiments").exists()


def test_recipe_ls_json_is_the_catalogue(tmp_path: Path) -> None:
    done = run_tp("recipe", "ls", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    recipes = json.loads(done.stdout)["recipes"]
    catalogue = Catalogue.bundled()
    assert [r["method_id"] for r in recipes] == [r.method_id for r in catalogue]
    assert [r["digest"] for r in recipes] == [r.digest for r in catalogue]
    human = run_tp("recipe", "ls", cwd=tmp_path)
    assert "pytorch/process-group" in human.stdout


def test_recipe_upgrade_says_what_changed(project: Path) -> None:
    lock = project / "experiments" / "hello" / "recipe.lock.json"
    raw = json.loads(lock.read_text())
    current = raw["recipe_digest"]
    raw["recipe_digest"] = "sha256:" + "0" * 64
    lock.write_text(json.dumps(raw))
    stale = run_tp("submit", "hello", "--profile", "h200:1", "--preview", cwd=project)
    assert stale.returncode == 1
    assert "Run `tp recipe upgrade hello`" in stale.stderr
    done = run_tp("recipe", "upgrade", "hello", cwd=project / "experiments")
    assert done.returncode == 0, done.stderr
    assert f"recipe_digest: sha256:{'0' * 64} -> {current}" in done.stdout
    assert json.loads(lock.read_text())["recipe_digest"] == current
    again = run_tp("recipe", "upgrade", "hello", cwd=project)
    assert "already current" in again.stdout


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("submit", "hello", "--profile", "h200:1"), "Say --preview"),
        (("submit", "hello", "--profile", "h200:1", "--preview", "--yes"), "Say --preview"),
        (("submit", "--profile", "h200:1", "--preview"), "Name the experiment"),
        (("submit", "hello", "--commit", "pv-1"), "--commit takes only the preview"),
        (("submit", "hello", "--profile", "h200:1", "--param", "x=1", "--preview"), "no param"),
        (("submit", "hello", "--profile", "H200", "--preview"), "is not a Profile"),
        (("submit", "hello", "--preview"), "No Profile given"),
        (("job", "show"), "Missing argument"),
        (("job", "ls", "--state", "runing"), "'runing' is not one of"),
        (("frobnicate",), "No such command"),
    ],
)
def test_usage_errors_exit_2(project: Path, args: tuple[str, ...], expected: str) -> None:
    done = run_tp(*args, cwd=project)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert expected in done.stderr
    assert "Traceback" not in done.stderr


def test_missing_connection_names_the_flags_and_variables(project: Path) -> None:
    done = run_tp("submit", "hello", "--profile", "h200:1", "--preview", cwd=project)
    assert done.returncode == 2
    assert "--context" in done.stderr and "TUNEPLANE_CONTEXT" in done.stderr
    assert "--coordinator" in done.stderr and "TUNEPLANE_COORDINATOR" in done.stderr
    assert not (project / ".tuneplane-data").exists()


def _context(tmp_path: Path, **values: str) -> Path:
    path = tmp_path / "tp-context.json"
    path.write_text(json.dumps(values))
    return path


def test_context_file_problems(project: Path, tmp_path: Path) -> None:
    missing = run_tp("job", "ls", cwd=project, env={"TUNEPLANE_CONTEXT": str(tmp_path / "no")})
    assert missing.returncode == 2
    assert "does not exist" in missing.stderr and "tp-context.json" in missing.stderr

    (tmp_path / "token").write_text("secret\n")
    ctx = _context(tmp_path, coordinator="127.0.0.1:1", ca="ca.pem", token_file="token")
    no_ca = run_tp("job", "ls", cwd=project, env={"TUNEPLANE_CONTEXT": str(ctx)})
    assert no_ca.returncode == 2
    assert f"The CA file {tmp_path / 'ca.pem'} does not exist" in no_ca.stderr

    ctx = _context(tmp_path, coordinator="nohostport", ca="ca.pem", token_file="token")
    bad_addr = run_tp("--context", str(ctx), "job", "ls", cwd=project)
    assert bad_addr.returncode == 2
    assert "is not HOST:PORT" in bad_addr.stderr


def test_flags_override_the_context_and_bad_ca_or_token_are_usage_errors(
    project: Path, tmp_path: Path
) -> None:
    not_a_cert = tmp_path / "ca.pem"
    not_a_cert.write_text("not a certificate\n")
    empty_token = tmp_path / "token"
    empty_token.write_text("\n")
    ctx = _context(tmp_path, coordinator="127.0.0.1:1", ca="ca.pem", token_file="token")
    env = {"TUNEPLANE_CONTEXT": str(ctx)}
    no_token = run_tp("job", "ls", cwd=project, env=env)
    assert no_token.returncode == 2
    assert f"The token file {empty_token} does not hold a token" in no_token.stderr
    good_token = tmp_path / "good-token"
    good_token.write_text("tok\n")
    bad_ca = run_tp("--token-file", str(good_token), "job", "ls", cwd=project, env=env)
    assert bad_ca.returncode == 2
    assert f"The CA file {not_a_cert} cannot be loaded" in bad_ca.stderr


def _real_ca(tmp_path: Path) -> Path:
    """A dev CA made by the real ``tuneplane-coordinator init``."""
    state = tmp_path / "coordinator"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tuneplane.coordinator.cli.admin",
            "init",
            "--state-dir",
            str(state),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return state / "tls" / "ca.pem"


def test_unreachable_coordinator_is_a_refusal_with_a_sentence(
    project: Path, tmp_path: Path
) -> None:
    # A port that was just free: nothing listens there.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ca = _real_ca(tmp_path)
    token = tmp_path / "token"
    token.write_text("tok\n")
    args = ("--coordinator", f"127.0.0.1:{port}", "--ca", str(ca), "--token-file", str(token))
    done = run_tp(*args, "job", "ls", cwd=project)
    assert done.returncode == 1
    assert f"Cannot reach the coordinator at 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr


def test_python_dash_m_and_version(tmp_path: Path) -> None:
    done = run_tp("--version", cwd=tmp_path)
    assert done.returncode == 0
    assert done.stdout.startswith("tp, version ")
    helped = run_tp("submit", "--help", cwd=tmp_path)
    assert helped.returncode == 0 and "--preview" in helped.stdout
