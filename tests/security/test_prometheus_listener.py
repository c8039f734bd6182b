"""The Prometheus listeners are opened only when asked, on loopback unless told otherwise, and a
listener that cannot be opened, or settings that are wrong, stop the process before it changes
anything: real coordinators and agents, real sockets, the journal and store compared byte for
byte."""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.support.agent import start_agent
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.prometheus import scrape
from tuneplane.agent.metrics_listener import DEFAULT_NODE_PORT


def _listening(pid: int) -> set[tuple[str, int]]:
    """The TCP addresses process ``pid`` listens on."""
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    }


def _files(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` and the sha256 of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port another process's socket holds for the test."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        yield int(holder.getsockname()[1])


@pytest.fixture
def coord(tmp_path: Path) -> Iterator[CoordinatorProcess]:
    with start_coordinator(tmp_path) as running:
        yield running


def test_neither_process_listens_for_metrics_by_default(
    coord: CoordinatorProcess, tmp_path: Path
) -> None:
    agent = start_agent(tmp_path, coord, "node-a")
    try:
        status = agent.wait_connected()
        assert status["metrics_address"] == ""
        assert "metrics:" not in agent.cli("status").stdout
        # Besides dialing out, the agent listens only for its outputs (docs/operator.md).
        outputs = agent.wait_connected()["outputs_address"]
        out_port = outputs.rsplit(":", 1)[1]
        assert _listening(agent.pid) == {("127.0.0.1", int(out_port))}
        with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
            probe.connect(("127.0.0.1", DEFAULT_NODE_PORT))
    finally:
        agent.stop()
    endpoints = json.loads((coord.state_dir / "endpoints.json").read_text())
    assert endpoints["metrics"] == ""
    grpc = {int(endpoints[name].rsplit(":", 1)[1]) for name in ("api", "control", "telemetry")}
    assert {port for _ip, port in _listening(coord.pid)} == grpc


def test_an_enabled_agent_listener_without_host_binds_loopback_only(
    coord: CoordinatorProcess, tmp_path: Path
) -> None:
    agent = start_agent(tmp_path, coord, "node-a", node_toml="[metrics]\nport = 0\n")
    try:
        address = agent.wait_connected()["metrics_address"]
        host, port = address.rsplit(":", 1)
        assert host == "127.0.0.1"
        outputs = int(agent.wait_connected()["outputs_address"].rsplit(":", 1)[1])
        assert _listening(agent.pid) == {("127.0.0.1", int(port)), ("127.0.0.1", outputs)}
        assert scrape(address).value("tuneplane_node_connected") is not None
        assert f"metrics: http://{address}/metrics\n" in agent.cli("status").stdout
    finally:
        agent.stop()


def test_a_taken_port_stops_the_agent_before_its_journal_is_touched(
    coord: CoordinatorProcess, tmp_path: Path, taken_port: int
) -> None:
    agent = start_agent(tmp_path, coord, "node-a", node_toml=f"[metrics]\nport = {taken_port}\n")
    code = agent.wait_exit()
    log = agent.read_log()
    assert code == 1, log
    assert (
        f"The metrics listener cannot listen on 127.0.0.1:{taken_port} (Address already in use). "
        "Change port in [metrics] in node.toml (0 picks a free port)"
    ) in log
    # A second start fails the same way and leaves every file of the state dir as it was.
    before = _files(agent.state_dir)
    assert "journal.db" in before
    agent.start()
    assert agent.wait_exit() == 1
    assert _files(agent.state_dir) == before
    assert not agent.status_path.exists()
    # The journal holds the enrolment only: no agent start was ever journaled.
    events = json.loads(agent.cli("journal", "events", "--json").stdout)
    assert [e["kind"] for e in events] == ["enrolled"]
    nodes = json.loads(
        subprocess.run(
            [sys.executable, "-m", "tuneplane.coordinator.cli.tp", "--context",
             str(coord.context_path), "node", "ls", "--json"],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout
    )  # fmt: skip
    assert [n["connected"] for n in nodes] == [False]


@pytest.mark.parametrize(
    ("table", "sentence"),
    [
        ('port = "7447"', "[metrics] port = '7447' must be a whole number from 0"),
        ("port = 70000", "[metrics] port = 70000 must be a whole number from 0"),
        ('host = "localhost"', "[metrics] host = 'localhost' is not an IP address"),
        ("listen = 1", "[metrics] has unknown key(s) listen"),
    ],
)
def test_wrong_agent_settings_are_refused_naming_the_key(
    coord: CoordinatorProcess, tmp_path: Path, table: str, sentence: str
) -> None:
    agent = start_agent(tmp_path, coord, "node-a", node_toml=f"[metrics]\n{table}\n")
    code = agent.wait_exit()
    log = agent.read_log()
    assert code != 0 and sentence in log, log
    assert str(agent.config_path) in log
    assert not agent.status_path.exists()


def _init(tmp_path: Path, config: str) -> Path:
    """``tuneplane-coordinator init`` with ``config`` appended to coordinator.toml."""
    state_dir = tmp_path / "coordinator"
    subprocess.run(
        [sys.executable, "-m", "tuneplane.coordinator.cli.admin", "init", "--state-dir",
         str(state_dir)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    with open(state_dir / "coordinator.toml", "a", encoding="utf-8") as toml:
        toml.write(config)
    return state_dir


@pytest.mark.parametrize(
    ("config", "sentence"),
    [
        ("[metrics]\nport = {taken}\n", "The metrics listener cannot listen on 127.0.0.1:{taken}"),
        ("[metrics]\nport = -1\n", "[metrics] port = -1 must be a whole number from 0"),
        ('[metrics]\nhost = "0.0.0.0:7446"\n', "host = '0.0.0.0:7446' is not an IP address"),
        ("[metrics]\nport = 7446\nextra = true\n", "[metrics] has unknown key(s) extra"),
    ],
)
def test_the_coordinator_refuses_to_serve_on_a_taken_port_or_wrong_settings(
    tmp_path: Path, taken_port: int, config: str, sentence: str
) -> None:
    state_dir = _init(tmp_path, config.format(taken=taken_port))
    before = _files(state_dir)
    with pytest.raises(RuntimeError) as refused:
        start_coordinator(tmp_path)
    assert sentence.format(taken=taken_port) in str(refused.value)
    assert "Traceback" not in str(refused.value)
    # Nothing published, the store not opened.
    assert not (state_dir / "endpoints.json").exists()
    after = _files(state_dir)
    after.pop("serve.log")
    assert after == before
