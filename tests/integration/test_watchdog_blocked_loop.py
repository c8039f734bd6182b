"""The systemd watchdog vouches for the agent's event loop: a blocked loop stops the pings.

The test binds the notify socket and a socket in journald's place, starts the real
``tuneplane-node`` with ``NOTIFY_SOCKET``, a short ``WATCHDOG_USEC`` and
``TUNEPLANE_HANGPOINT=after-prepare-journaled:<s>`` (agent/crashpoint.py: the thread that reaches
that point sleeps, and that point is on the Trio loop, in ``Members.prepare``), and submits a
Job so a real Prepare reaches it. The journal entries "hang point reached" and "hang point over"
mark the blocked window: no WATCHDOG=1 arrives inside it, pings arrive before and after it, and
the Job still succeeds. A pinging thread would have kept pinging through the window; SIGSTOP
would have stopped every thread and proved nothing.

The coordinator pings with the same ``ServiceNotifier.keep_watchdog`` on its own loop; its fault
points (coordinator/faultpoint.py) only raise, so it is not blocked here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.agent.jobs import submit, wait_job
from tests.support.agent import start_agent
from tests.support.coordinator import start_coordinator
from tests.support.datagrams import Datagram, DatagramInbox, journal_fields, notify_fields
from tuneplane.agent.daemon_log import TEST_SOCKET_VARIABLE

pytestmark = pytest.mark.slow

WATCHDOG_USEC = "200000"  # a ping every 0.1 s
HANG_S = 2.0
# Two receiving threads stamp arrivals: allow this much disorder between the two sockets.
SLACK_S = 0.15


def _pings(inbox: DatagramInbox) -> list[Datagram]:
    return [d for d in inbox.received if notify_fields(d.data).get("WATCHDOG") == "1"]


def _entry(logs: DatagramInbox, text: str) -> Datagram | None:
    found = [d for d in logs.received if text in journal_fields(d.data).get("MESSAGE", "")]
    return found[0] if found else None


@pytest.mark.timeout(180)
def test_a_blocked_event_loop_stops_the_watchdog_pings_until_it_runs_again(
    tmp_path: Path,
) -> None:
    coordinator = start_coordinator(tmp_path)
    log_path = tmp_path / "node-a.log"  # start_agent's log; made now so its inode is known
    log_path.touch()
    st = log_path.stat()
    notify, journal_sock = f"@tuneplane-test-watchdog-{tmp_path.name}", tmp_path / "journal.sock"
    agent = None
    try:
        with DatagramInbox(notify) as inbox, DatagramInbox(str(journal_sock)) as logs:
            agent = start_agent(
                tmp_path,
                coordinator,
                env={
                    "NOTIFY_SOCKET": notify,
                    "WATCHDOG_USEC": WATCHDOG_USEC,
                    "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}",
                    TEST_SOCKET_VARIABLE: str(journal_sock),
                    "TUNEPLANE_HANGPOINT": f"after-prepare-journaled:{HANG_S:g}",
                },
            )
            assert agent.log_path == log_path
            agent.wait_connected()
            inbox.wait_for("five watchdog pings", lambda _: len(_pings(inbox)) >= 5)

            run_id = submit(coordinator, tmp_path / "proj", 'echo done > "$TUNEPLANE_OUT_DIR/x"\n')
            logs.wait_for("the hang's end", lambda _: _entry(logs, "hang point over"))
            reached, over = _entry(logs, "hang point reached"), _entry(logs, "hang point over")
            assert reached is not None and over is not None
            blocked = over.at_monotonic - reached.at_monotonic
            assert blocked >= HANG_S - SLACK_S, blocked
            assert journal_fields(reached.data)["TUNEPLANE_POINT"] == "after-prepare-journaled"

            # Pinged on the loop before it blocked, never while it was blocked, and again after.
            start, end = reached.at_monotonic + SLACK_S, over.at_monotonic - SLACK_S
            pings = _pings(inbox)
            assert [p for p in pings if p.at_monotonic < reached.at_monotonic]
            inside = [
                p.at_monotonic - reached.at_monotonic for p in pings if start < p.at_monotonic < end
            ]
            assert inside == [], f"pings {inside} s into a {blocked:.2f} s blocked loop"
            inbox.wait_for(
                "five watchdog pings after the loop ran again",
                lambda _: (
                    len([p for p in _pings(inbox) if p.at_monotonic > over.at_monotonic]) >= 5
                ),
            )
            done = wait_job(coordinator, run_id)
            assert done["state"] == "succeeded", done
            # A hang point blocks once per process.
            hangs = [d for d in logs.received if b"hang point reached" in d.data]
            assert len(hangs) == 1, hangs
    finally:
        if agent is not None and agent.alive():
            agent.stop()
        coordinator.stop()
