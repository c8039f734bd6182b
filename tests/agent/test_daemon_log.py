"""Daemon logging: journald's native protocol under systemd, the stderr format elsewhere.

The handler is run in a real subprocess (logging is process-wide) against a datagram socket the
test binds in journald's place; the key=value parsing is checked alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.datagrams import DatagramInbox, journal_fields
from tuneplane.agent.daemon_log import (
    TEST_SOCKET_VARIABLE,
    fields_of,
    journal_stream_is_stderr,
    priority,
)

_LOGS = """
import logging
from tuneplane.agent import daemon_log
daemon_log.configure(logging.INFO, "tuneplane-test", "%(levelname)s %(name)s %(message)s")
log = logging.getLogger("tuneplane.test")
log.info("member re-attached member=%s runner_pid=%d reason=%s", "r1.1.0", 77, "it is alive")
log.debug("not at info")
try:
    raise ValueError("bad\\nthing")
except ValueError:
    log.exception("failed member=%s", "r1.1.0")
log.warning("big blob=%s", "x" * 300000)
"""


# A process that works for one member (the collector) names it on every entry.
_MEMBER_LOGS = """
import logging
from tuneplane.agent import daemon_log
fields = {"run_id": "r1", "attempt": "2", "member_index": "0", "member": "r1.2.0"}
daemon_log.configure(logging.INFO, "tuneplane-test", "%(message)s", fields=fields)
print(daemon_log.journald_in_use())
log = logging.getLogger("tuneplane.test")
log.info("member exited; draining run_id=%s member=%d", "r1", 0)
log.info("plain words")
"""


def _run(
    tmp_path: Path, env: dict[str, str], stderr: Path, script: str = _LOGS
) -> subprocess.CompletedProcess[str]:
    with open(stderr, "w") as err:
        return subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, **env}, stderr=err, stdout=subprocess.PIPE,
            text=True, timeout=60, check=False, cwd=tmp_path,
        )  # fmt: skip


def _stream_of(path: Path) -> str:
    st = path.stat()
    return f"{st.st_dev}:{st.st_ino}"


def test_key_value_pairs_become_journal_fields() -> None:
    assert fields_of("agent started pid=12 previous_stop=unclean reason=killed with -9") == {
        "TUNEPLANE_PID": "12",
        "TUNEPLANE_PREVIOUS_STOP": "unclean",
        "TUNEPLANE_REASON": "killed with -9",
    }
    assert fields_of("no fields here") == {}
    assert fields_of("a=1 a=2 url=http://h/?q=1") == {
        "TUNEPLANE_A": "1",
        "TUNEPLANE_URL": "http://h/?q=1",
    }
    assert [priority(n) for n in (50, 40, 30, 20, 10)] == [2, 3, 4, 6, 7]


def test_the_journal_is_used_only_when_journal_stream_is_our_stderr(tmp_path: Path) -> None:
    mine, other = tmp_path / "mine", tmp_path / "other"
    mine.touch()
    other.touch()
    with open(mine) as f:
        assert journal_stream_is_stderr({"JOURNAL_STREAM": _stream_of(mine)}, f.fileno())
        assert not journal_stream_is_stderr({"JOURNAL_STREAM": _stream_of(other)}, f.fileno())
        assert not journal_stream_is_stderr({"JOURNAL_STREAM": "junk"}, f.fileno())
        assert not journal_stream_is_stderr({}, f.fileno())


def test_under_systemd_each_record_is_one_native_journal_entry(tmp_path: Path) -> None:
    sock, stderr = tmp_path / "journal.sock", tmp_path / "stderr"
    stderr.touch()
    with DatagramInbox(str(sock)) as inbox:
        env = {"JOURNAL_STREAM": _stream_of(stderr), TEST_SOCKET_VARIABLE: str(sock)}
        done = _run(tmp_path, env, stderr)
        assert done.returncode == 0, stderr.read_text()
        inbox.wait_for("three entries", lambda got: len(got) == 3)
    assert stderr.read_text() == ""
    reattached, failed, big = (journal_fields(d.data) for d in inbox.received)
    assert (
        reattached["MESSAGE"] == "member re-attached member=r1.1.0 runner_pid=77 reason=it is alive"
    )
    assert reattached["PRIORITY"] == "6"
    assert reattached["SYSLOG_IDENTIFIER"] == "tuneplane-test"
    assert reattached["LOGGER"] == "tuneplane.test"
    assert reattached["CODE_LINE"] == "6"
    assert reattached["TUNEPLANE_MEMBER"] == "r1.1.0"
    assert reattached["TUNEPLANE_RUNNER_PID"] == "77"
    assert reattached["TUNEPLANE_REASON"] == "it is alive"
    assert failed["PRIORITY"] == "3"
    assert "ValueError: bad\nthing" in failed["MESSAGE"]
    assert failed["TUNEPLANE_MEMBER"] == "r1.1.0"
    # Past a datagram's size the entry travels as a sealed memfd, whole.
    assert big["TUNEPLANE_BLOB"] == "x" * 300000


def test_a_process_s_own_fields_are_on_every_entry_and_win_over_the_line_s(
    tmp_path: Path,
) -> None:
    sock, stderr = tmp_path / "journal.sock", tmp_path / "stderr"
    stderr.touch()
    with DatagramInbox(str(sock)) as inbox:
        env = {"JOURNAL_STREAM": _stream_of(stderr), TEST_SOCKET_VARIABLE: str(sock)}
        done = _run(tmp_path, env, stderr, _MEMBER_LOGS)
        assert done.returncode == 0, stderr.read_text()
        inbox.wait_for("two entries", lambda got: len(got) == 2)
    assert done.stdout.strip() == "True"
    draining, plain = (journal_fields(d.data) for d in inbox.received)
    for entry in (draining, plain):
        assert entry["TUNEPLANE_RUN_ID"] == "r1"
        assert entry["TUNEPLANE_ATTEMPT"] == "2"
        assert entry["TUNEPLANE_MEMBER_INDEX"] == "0"
        assert entry["TUNEPLANE_MEMBER"] == "r1.2.0"
    # The line's member=0 is its index; the field keeps the process's name for the member.
    assert draining["MESSAGE"] == "member exited; draining run_id=r1 member=0"
    assert plain["MESSAGE"] == "plain words"
    # Outside systemd the fields are not written into the stderr format.
    done = _run(tmp_path, {TEST_SOCKET_VARIABLE: str(sock)}, stderr, _MEMBER_LOGS)
    assert done.stdout.strip() == "False"
    assert stderr.read_text().splitlines() == [
        "member exited; draining run_id=r1 member=0",
        "plain words",
    ]


def test_outside_systemd_the_stderr_format_is_kept(tmp_path: Path) -> None:
    sock, stderr = tmp_path / "journal.sock", tmp_path / "stderr"
    with DatagramInbox(str(sock)) as inbox:
        done = _run(tmp_path, {TEST_SOCKET_VARIABLE: str(sock)}, stderr)
        assert done.returncode == 0, stderr.read_text()
    lines = stderr.read_text().splitlines()
    assert lines[0] == (
        "INFO tuneplane.test member re-attached member=r1.1.0 runner_pid=77 reason=it is alive"
    )
    assert inbox.received == []


def test_a_journal_that_cannot_be_reached_falls_back_to_stderr(tmp_path: Path) -> None:
    stderr = tmp_path / "stderr"
    stderr.touch()
    env = {"JOURNAL_STREAM": _stream_of(stderr), TEST_SOCKET_VARIABLE: str(tmp_path / "none")}
    done = _run(tmp_path, env, stderr)
    assert done.returncode == 0, stderr.read_text()
    text = stderr.read_text()
    assert "INFO tuneplane.test member re-attached member=r1.1.0 runner_pid=77" in text
    assert "ValueError: bad" in text
