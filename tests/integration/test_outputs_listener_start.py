"""The outputs listener as the daemon starts it: a port another program holds stops the agent at
start with a sentence naming ``[outputs] listen`` and nothing journaled; ``listen = ""`` runs the
agent with no listener; ``status`` and ``doctor`` say which."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.support.agent import start_agent
from tests.support.coordinator import start_coordinator
from tuneplane.agent.outputs_identity import GRANT_KEY_FILE, TLS_FILE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _journal_files(state_dir: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in state_dir.glob("journal.db*")}


def test_a_taken_port_stops_the_agent_naming_the_setting(tmp_path: Path) -> None:
    with socket.socket() as taken, start_coordinator(tmp_path / "coord") as coord:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        listen = f"127.0.0.1:{port}"
        agent = start_agent(
            tmp_path, coord, "node-a", node_toml=f'[outputs]\nlisten = "{listen}"\n'
        )
        code = agent.wait_exit()
        said = " ".join(agent.read_log().split())
        assert code == 1, said
        assert f'[outputs] listen = "{listen}" cannot be bound' in said
        assert str(agent.config_path) in said and 'listen = ""' in said
        assert "Traceback" not in said
        # Stopped before the journal was opened: no start is journaled, no status written.
        assert "agent started" not in said
        assert not agent.status_path.exists()

        # The port free again, the same agent starts and serves there.
        taken.close()
        agent.start()
        status = agent.wait_connected()
        assert status["outputs_listen"] == listen
        creds = agent.state_dir / "credentials"
        for name in (GRANT_KEY_FILE, TLS_FILE):
            assert (creds / name).stat().st_mode & 0o777 == 0o600
        # The key and certificate were made in a child: the serving agent maps no cryptography.
        mapped = Path(f"/proc/{agent.pid}/maps").read_text()
        assert "libpython" in mapped or "python" in mapped
        assert "cryptography" not in mapped
        shown = agent.cli("status")
        assert f"outputs listener: {listen}" in shown.stdout, shown.stdout
        doctor = agent.cli("doctor")
        assert f"outputs listener: listening at {listen}, advertised to other Nodes as " in (
            doctor.stdout
        ), doctor.stdout
        agent.stop()


def test_an_empty_listen_runs_no_listener(tmp_path: Path) -> None:
    with start_coordinator(tmp_path / "coord") as coord:
        agent = start_agent(tmp_path, coord, "node-a", node_toml='[outputs]\nlisten = ""\n')
        try:
            status = agent.wait_connected()
            assert status["outputs_listen"] == "" and status["outputs_address"] == ""
            assert not (agent.state_dir / "credentials" / TLS_FILE).exists()
            doctor = agent.cli("doctor")
            assert 'outputs listener: off ([outputs] listen = "")' in doctor.stdout
        finally:
            agent.stop()
