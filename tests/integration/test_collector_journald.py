"""Under systemd a member's collector logs to journald as its agent does, naming its member.

The real agent runs with ``JOURNAL_STREAM`` naming its stderr (as systemd sets it) and a socket
in journald's place; a Job runs and ends. The agent hands the collector it spawns its own stderr
(agent/collectors.py), so the collector's agent/daemon_log.py sees the journal stream too: its
lines arrive as journal entries from the collector's own process, with
``SYSLOG_IDENTIFIER=tuneplane-collector`` and the member's run, attempt and index on every one,
and ``TUNEPLANE_MEMBER`` as the agent writes it, so one filter shows both daemons' lines.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.agent.jobs import submit, wait_job
from tests.support.agent import start_agent
from tests.support.coordinator import start_coordinator
from tests.support.datagrams import Datagram, DatagramInbox, journal_fields
from tuneplane.agent.daemon_log import TEST_SOCKET_VARIABLE

pytestmark = pytest.mark.slow


def _from(logs: DatagramInbox, identifier: str) -> list[tuple[Datagram, dict[str, str]]]:
    entries = ((d, journal_fields(d.data)) for d in logs.received)
    return [(d, f) for d, f in entries if f.get("SYSLOG_IDENTIFIER") == identifier]


@pytest.mark.timeout(180)
def test_a_collector_logs_to_journald_with_its_member_when_its_agent_does(tmp_path: Path) -> None:
    coordinator = start_coordinator(tmp_path)
    log_path = tmp_path / "node-a.log"  # start_agent's log; made now so its inode is known
    log_path.touch()
    st = log_path.stat()
    journal_sock = tmp_path / "journal.sock"
    agent = None
    try:
        with DatagramInbox(str(journal_sock)) as logs:
            agent = start_agent(
                tmp_path,
                coordinator,
                env={
                    "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}",
                    TEST_SOCKET_VARIABLE: str(journal_sock),
                },
            )
            assert agent.log_path == log_path
            agent.wait_connected()
            script = 'echo \'{"step": 1, "loss": 0.5}\' > "$TUNEPLANE_TELEMETRY_DIR/m.jsonl"\n'
            run_id = submit(coordinator, tmp_path / "proj", script)
            assert wait_job(coordinator, run_id)["state"] == "succeeded"
            key = f"{run_id}.1.0"
            # Its last entry, not its drain entry: the sampler's first line can come after the
            # drain's, and once this socket closes a line would (rightly) fall back to stderr.
            logs.wait_for(
                "the collector's last entry",
                lambda _: any(
                    "collector done" in f["MESSAGE"] for _, f in _from(logs, "tuneplane-collector")
                ),
            )
            collector = _from(logs, "tuneplane-collector")
            agent_entries = [f for _, f in _from(logs, "tuneplane-node")]
        for datagram, fields in collector:
            assert fields["TUNEPLANE_RUN_ID"] == run_id, fields
            assert fields["TUNEPLANE_ATTEMPT"] == "1", fields
            assert fields["TUNEPLANE_MEMBER_INDEX"] == "0", fields
            # The line says member=0 (its index); the field names the member as the agent does.
            assert fields["TUNEPLANE_MEMBER"] == key, fields
            assert fields["LOGGER"].startswith("tuneplane.collector"), fields
            assert datagram.sender_pid not in (0, agent.pid), "sent by the collector's process"
        # One filter, both daemons: the agent's lines about this member carry the same field.
        assert any(
            f.get("TUNEPLANE_MEMBER") == key and "collector started" in f["MESSAGE"]
            for f in agent_entries
        )
        # Nothing went to a file instead: no collector.log, and stderr (the stream) stayed empty.
        assert not (agent.state_dir / "collectors" / key / "collector.log").exists()
        assert "tuneplane.collector" not in log_path.read_text()
    finally:
        if agent is not None and agent.alive():
            agent.stop()
        coordinator.stop()
