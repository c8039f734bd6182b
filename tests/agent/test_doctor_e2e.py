"""doctor against a real coordinator and a real agent: what it says about a healthy Node, a
missing interpreter, a stopped coordinator, and the GPU source it shares with ``status``."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent.jobs import wait_job
from tests.faults.jobs import project, submit
from tests.support.agent import AgentProcess, node_cli, start_agent, wait_until
from tests.support.coordinator import CoordinatorProcess, start_coordinator

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[CoordinatorProcess, AgentProcess]]:
    tmp_path = tmp_path_factory.mktemp("doctor")
    with start_coordinator(tmp_path) as coordinator:
        agent = start_agent(tmp_path, coordinator)
        try:
            agent.wait_connected()
            yield coordinator, agent
        finally:
            agent.stop()


def lines(done: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """doctor's lines by what they are about: ``{"coordinator control address": "ok    ..."}``."""
    found: dict[str, str] = {}
    for line in done.stdout.splitlines():
        for about in ("inventory source", "coordinator control address",
                      "coordinator telemetry address", "clock skew",
                      "disk space under the output root", "disk space under the work root",
                      "disk space under the state dir", "runtime host:python3"):  # fmt: skip
            if line[6:].startswith(about):
                found[about] = line
    return found


def test_a_healthy_node(cluster: tuple[CoordinatorProcess, AgentProcess]) -> None:
    _, agent = cluster
    wait_until("the Welcome's clock skew", lambda: agent.status().get("clock_skew_at_ms"))
    node = json.loads((agent.state_dir / "node.json").read_text())
    done = agent.cli("doctor")
    got = lines(done)
    assert done.returncode == 0, done.stdout
    assert got["coordinator control address"].startswith(
        f"ok    coordinator control address {node['coordinator']} is reachable: TLSv1."
    )
    # No Commit yet: the telemetry address is not known, and doctor says so without failing.
    assert got["coordinator telemetry address"] == (
        "      coordinator telemetry address: not known yet (the coordinator hands it out with "
        "each Commit; this Node has had none)"
    )
    assert got["clock skew"].startswith("ok    clock skew to the coordinator: its clock is 0.")
    assert "measured by the agent at its last Welcome" in got["clock skew"]
    assert got["runtime host:python3"].startswith("ok    runtime host:python3 (the default)")
    assert ", Python 3." in got["runtime host:python3"]
    # The roots the running agent uses, not node.toml's defaults.
    roots = {
        "state dir": agent.state_dir,
        "work root": agent.work_root,
        "output root": agent.out_root,
    }
    for about, root in roots.items():
        line = got[f"disk space under the {about}"]
        assert line[:6] in ("ok    ", "warn  "), line
        assert line[6:].startswith(f"disk space under the {about} {root}: "), line
        assert "GiB free of" in line, line


def test_doctor_and_status_agree_on_a_simulated_source(
    cluster: tuple[CoordinatorProcess, AgentProcess],
) -> None:
    _, agent = cluster
    status = json.loads(agent.cli("status", "--json").stdout)
    assert status["inventory"]["gpu_source"] == "simulated"
    assert len(status["inventory"]["gpus"]) == 2
    line = lines(agent.cli("doctor"))["inventory source"]
    assert line.startswith(
        f"warn  inventory source: the running agent (pid {agent.pid}) uses simulated (2 GPUs), "
        "not the driver, while doctor reads "
    ), line


def test_a_missing_interpreter_fails_with_its_name_and_the_fix(
    cluster: tuple[CoordinatorProcess, AgentProcess], tmp_path: Path
) -> None:
    _, agent = cluster
    config = tmp_path / "node.toml"
    config.write_text(
        agent.config_path.read_text()
        + '[runtimes.bash]\npath = "/usr/bin:/bin"\ninterpreter = "/opt/missing/bash"\n'
    )
    done = subprocess.run(
        node_cli("--config", str(config), "doctor", "--state-dir", str(agent.state_dir)),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    (line,) = [ln for ln in done.stdout.splitlines() if "runtime host:bash" in ln]
    assert line.startswith("FAIL  runtime host:bash (node.toml): interpreter /opt/missing/bash")
    assert "/opt/missing/bash is not an executable file, set interpreter in [runtimes.bash]" in line


def test_the_telemetry_listener_is_probed_once_a_commit_named_it(
    cluster: tuple[CoordinatorProcess, AgentProcess], tmp_path: Path
) -> None:
    coordinator, agent = cluster
    root = project(coordinator, tmp_path / "proj", "custom/custom", {"train.sh": "true\n"})
    assert wait_job(coordinator, submit(coordinator, root, "h200:1"))["state"] == "succeeded"
    line = lines(agent.cli("doctor"))["coordinator telemetry address"]
    assert line.startswith(
        f"ok    coordinator telemetry address {coordinator.telemetry} is reachable: TLSv1."
    ), line


def test_a_stopped_coordinator_fails_reachability_with_the_address(
    cluster: tuple[CoordinatorProcess, AgentProcess],
) -> None:
    coordinator, agent = cluster
    address = json.loads((agent.state_dir / "node.json").read_text())["coordinator"]
    coordinator.stop()
    try:
        done = agent.cli("doctor")
        assert done.returncode == 1
        assert lines(done)["coordinator control address"].startswith(
            f"FAIL  coordinator control address {address} is not reachable: "
        ), done.stdout
        assert lines(done)["coordinator telemetry address"].startswith(
            "FAIL  coordinator telemetry address "
        ), done.stdout
        assert "Check that the coordinator runs" in done.stdout
    finally:
        coordinator.restart()
        agent.wait_connected()
