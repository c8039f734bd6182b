"""``tuneplane-node enroll`` against a real coordinator over TLS."""

from __future__ import annotations

import json
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.agent import enroll, node_cli
from tests.support.coordinator import CoordinatorProcess, start_coordinator


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[CoordinatorProcess]:
    with start_coordinator(tmp_path) as coord:
        yield coord


def _enroll_with(
    coord: CoordinatorProcess, state_dir: Path, token: str, ca: Path
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        node_cli(
            "enroll", "--state-dir", str(state_dir), "--coordinator", coord.control,
            "--ca", str(ca), "--token", token, "--simulate-gpus", "h200:2",
        ),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_enroll_writes_private_identity(coordinator: CoordinatorProcess, tmp_path: Path) -> None:
    state = tmp_path / "node"
    done = enroll(state, coordinator, "node-a", "h200:2")
    assert done.returncode == 0, done.stderr
    node = json.loads((state / "node.json").read_text())
    assert node["node_id"] in done.stdout and node["fleet"] == "default"
    # The hint runs the Node with the GPU source it enrolled with.
    assert f"start it with: tuneplane-node run --state-dir {state} --simulate-gpus h200:2" in (
        done.stdout
    )
    assert (state / "ca.pem").read_bytes() == coordinator.ca_path.read_bytes()
    assert stat.S_IMODE((state / "credentials").stat().st_mode) == 0o700
    assert stat.S_IMODE((state / "credentials" / "control.token").stat().st_mode) == 0o600
    # The journal records that a credential exists and when, never its value.
    token = (state / "credentials" / "control.token").read_text().strip()
    export = subprocess.run(
        node_cli("journal", "export", "--json", "--state-dir", str(state)),
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert json.loads(export)["credentials"][0]["name"] == "control"
    assert token not in export

    again = enroll(state, coordinator, "node-a", "h200:2")
    assert again.returncode == 1
    assert f"already enrolled as Node {node['node_id']}" in again.stderr


def test_a_join_token_works_once(coordinator: CoordinatorProcess, tmp_path: Path) -> None:
    token = coordinator.create_join_token()
    first = _enroll_with(coordinator, tmp_path / "a", token, coordinator.ca_path)
    assert first.returncode == 0, first.stderr
    second = _enroll_with(coordinator, tmp_path / "b", token, coordinator.ca_path)
    assert second.returncode == 1
    assert "refused" in second.stderr and "Traceback" not in second.stderr
    assert not (tmp_path / "b" / "node.json").exists()


def test_a_coordinator_not_signed_by_the_ca_is_refused(
    coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    other = tmp_path / "other"
    subprocess.run(
        [*node_cli()[:2], "tuneplane.coordinator.cli.admin", "init", "--state-dir", str(other)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    done = _enroll_with(
        coordinator, tmp_path / "a", coordinator.create_join_token(), other / "tls" / "ca.pem"
    )
    assert done.returncode == 1
    assert "does not verify against the CA" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "a").exists()


def test_an_unreachable_coordinator_is_a_sentence(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("not a certificate\n")
    done = subprocess.run(
        node_cli(
            "enroll", "--state-dir", str(tmp_path / "a"), "--coordinator", "127.0.0.1:1",
            "--ca", str(ca), "--token", "x",
        ),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    assert str(ca) in done.stderr and "Traceback" not in done.stderr
