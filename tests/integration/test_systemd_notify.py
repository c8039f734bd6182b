"""Type=notify and journald with the real daemons: what systemd would receive from each.

The test binds the notify socket and a socket in journald's place, starts the real coordinator
and the real agent with ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and ``JOURNAL_STREAM`` (naming the
file their stderr goes to, as systemd sets it), and checks: READY=1 comes only once the
coordinator's listeners accept (checked the moment it arrives) and once the agent has replayed
its journal and re-attached its live member (the journal's own timestamps); WATCHDOG=1 keeps
coming; STOPPING=1 comes on SIGTERM; log lines arrive as journal entries with TUNEPLANE_* fields.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.agent.jobs import journal, submit
from tests.faults.jobs import runner_alive, wait_state
from tests.support.agent import start_agent
from tests.support.coordinator import start_coordinator
from tests.support.datagrams import Datagram, DatagramInbox, journal_fields, notify_fields
from tuneplane.agent.daemon_log import TEST_SOCKET_VARIABLE

pytestmark = pytest.mark.slow

WATCHDOG_USEC = "400000"  # a ping every 0.2 s


def _stream_of(path: Path) -> str:
    st = path.stat()
    return f"{st.st_dev}:{st.st_ino}"


def _notified(inbox: DatagramInbox, key: str) -> list[Datagram]:
    return [d for d in inbox.received if key in notify_fields(d.data)]


def _entries(inbox: DatagramInbox, text: str) -> list[dict[str, str]]:
    found = (journal_fields(d.data) for d in inbox.received)
    return [f for f in found if text in f.get("MESSAGE", "")]


def _accepts(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            return True
    except OSError:
        return False


def test_the_coordinator_is_ready_only_when_its_listeners_accept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    coordinator = start_coordinator(tmp_path)
    coordinator.stop()  # made the state directory and serve.log, whose inode systemd would name
    accepted: dict[str, bool] = {}

    def at_arrival(got: Datagram) -> None:
        fields = notify_fields(got.data)
        if fields.get("READY") == "1":
            # "serving api=H:P control=H:P telemetry=H:P", tried while READY is fresh.
            for pair in fields["STATUS"].split()[1:]:
                name, address = pair.split("=", 1)
                accepted[name] = _accepts(address)

    notify, journal_sock = tmp_path / "notify.sock", tmp_path / "journal.sock"
    with DatagramInbox(str(notify), at_arrival) as inbox, DatagramInbox(str(journal_sock)) as logs:
        monkeypatch.setenv("NOTIFY_SOCKET", str(notify))
        monkeypatch.setenv("WATCHDOG_USEC", WATCHDOG_USEC)
        monkeypatch.setenv("JOURNAL_STREAM", _stream_of(coordinator.log_path))
        monkeypatch.setenv(TEST_SOCKET_VARIABLE, str(journal_sock))
        coordinator.start()
        try:
            inbox.wait_for("READY=1", lambda _: _notified(inbox, "READY"))
            assert not inbox.errors, inbox.errors
            assert accepted == {"api": True, "control": True, "telemetry": True}
            (ready,) = _notified(inbox, "READY")
            assert notify_fields(ready.data)["STATUS"].startswith(f"serving api={coordinator.api}")
            inbox.wait_for("five watchdog pings", lambda _: len(_notified(inbox, "WATCHDOG")) >= 5)
        finally:
            coordinator.stop()
        inbox.wait_for("STOPPING=1", lambda _: _notified(inbox, "STOPPING"))
        # The same line the stderr log has, with its key=value fields as journal fields.
        (entry,) = _entries(logs, "coordinator ready")
    assert entry["SYSLOG_IDENTIFIER"] == "tuneplane-coordinator"
    assert entry["PRIORITY"] == "6"
    assert entry["TUNEPLANE_API"] == coordinator.api
    assert entry["TUNEPLANE_CONTROL"] == coordinator.control
    assert entry["TUNEPLANE_TELEMETRY"] == coordinator.telemetry
    assert _entries(logs, "coordinator stopped")


@pytest.mark.timeout(300)
def test_the_agent_is_ready_once_its_journal_is_replayed_and_its_member_reattached(
    tmp_path: Path,
) -> None:
    release = tmp_path / "release"
    coordinator = start_coordinator(tmp_path)
    agent = start_agent(tmp_path, coordinator)
    notify, journal_sock = f"@tuneplane-test-notify-{tmp_path.name}", tmp_path / "journal.sock"
    try:
        agent.wait_connected()
        run_id = submit(
            coordinator, tmp_path / "held", f'while [ ! -e "{release}" ]; do sleep 0.1; done\n'
        )
        wait_state(coordinator, run_id, "running")
        (member,) = journal(agent, "members", "--json")
        key = f"{run_id}.1.0"
        with DatagramInbox(notify) as inbox, DatagramInbox(str(journal_sock)) as logs:
            agent.restart(
                env={
                    "NOTIFY_SOCKET": notify,
                    "WATCHDOG_USEC": WATCHDOG_USEC,
                    "JOURNAL_STREAM": _stream_of(agent.log_path),
                    TEST_SOCKET_VARIABLE: str(journal_sock),
                }
            )
            inbox.wait_for("READY=1", lambda _: _notified(inbox, "READY"))
            (ready,) = _notified(inbox, "READY")
            assert notify_fields(ready.data)["STATUS"].startswith("journal replayed; ")
            # The restart's own start and its re-attach were journaled before READY=1 arrived.
            (reattached,) = journal(agent, "events", "--kind", "member-reattached", "--json")
            starts = journal(agent, "events", "--node", "--kind", "agent-started", "--json")
            assert reattached["member"] == key
            assert starts[-1]["details"]["pid"] == agent.pid
            assert starts[-1]["at_ms"] <= reattached["at_ms"] <= ready.at_ms
            inbox.wait_for("five watchdog pings", lambda _: len(_notified(inbox, "WATCHDOG")) >= 5)
            inbox.wait_for(
                "the connected status",
                lambda _: any(
                    notify_fields(d.data).get("STATUS", "").startswith("connected to ")
                    for d in inbox.received
                ),
            )
            agent.stop()
            inbox.wait_for("STOPPING=1", lambda _: _notified(inbox, "STOPPING"))
            logs.wait_for("the re-attach entry", lambda _: _entries(logs, "member re-attached"))
        # systemd's stop (KillMode=process) signals the agent alone: the member still runs.
        assert runner_alive(Path(member["member_dir"]))
        (entry,) = _entries(logs, "member re-attached")
        assert entry["SYSLOG_IDENTIFIER"] == "tuneplane-node"
        assert entry["TUNEPLANE_MEMBER"] == key
        assert entry["TUNEPLANE_RUNNER_PID"] == str(reattached["details"]["runner_pid"])
        agent.start()
        release.write_text("go")
        wait_state(coordinator, run_id, "succeeded", timeout=60)
    finally:
        release.write_text("go")
        if agent.alive():
            agent.stop()
        coordinator.stop()
