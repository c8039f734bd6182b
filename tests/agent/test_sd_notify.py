"""sd_notify: what the environment asks for, the datagrams sent, and the watchdog loop's pace.

The pure parts are checked alone; the sending parts talk to a real datagram socket the test
binds (a path and an abstract name), as systemd's would be.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import cast

import trio

from tests.support.datagrams import DatagramInbox, notify_fields
from tuneplane.agent.daemon import Daemon, _tell_service_manager
from tuneplane.agent.daemon_status import Status, service_status
from tuneplane.agent.sd_notify import (
    NotifySettings,
    ServiceNotifier,
    encode,
    settings_from,
    socket_address,
)

PID = 4242


def test_without_a_socket_nothing_is_asked() -> None:
    assert settings_from({}, PID) == NotifySettings(None, None)
    assert settings_from({"WATCHDOG_USEC": "1000000"}, PID) == NotifySettings(None, None)
    assert not ServiceNotifier().ready("ready")


def test_the_watchdog_is_pinged_at_half_its_timeout_and_only_for_this_process() -> None:
    env = {"NOTIFY_SOCKET": "/run/n", "WATCHDOG_USEC": "3000000"}
    assert settings_from(env, PID).watchdog_interval_s == 1.5
    assert settings_from({**env, "WATCHDOG_PID": str(PID)}, PID).watchdog_interval_s == 1.5
    assert settings_from({**env, "WATCHDOG_PID": "1"}, PID).watchdog_interval_s is None
    for bad in ("", "0", "-5", "1e6", "soon"):
        assert settings_from({**env, "WATCHDOG_USEC": bad}, PID).watchdog_interval_s is None
    assert settings_from(env, PID).address == "/run/n"


def test_an_abstract_name_and_a_multi_line_status_are_encoded_as_systemd_reads_them() -> None:
    assert socket_address("@tuneplane/notify") == "\0tuneplane/notify"
    assert socket_address("/run/systemd/notify") == "/run/systemd/notify"
    assert encode({"READY": "1", "STATUS": "two\nlines"}) == b"READY=1\nSTATUS=two lines\n"


def test_the_variables_leave_the_environment_so_no_child_inherits_them() -> None:
    env = {"NOTIFY_SOCKET": "@n", "WATCHDOG_USEC": "10", "WATCHDOG_PID": str(os.getpid()), "A": "b"}
    notifier = ServiceNotifier.from_environment(env)
    assert env == {"A": "b"}
    # 10 microseconds asked: pinged as fast as is sane, not in a busy loop.
    assert notifier.settings == NotifySettings("@n", 0.01)


def test_ready_status_and_stopping_arrive_on_an_abstract_socket() -> None:
    name = f"@tuneplane-test-{uuid.uuid4().hex}"
    with DatagramInbox(name) as inbox:
        notifier = ServiceNotifier(NotifySettings(name))
        assert notifier.ready("serving")
        assert notifier.status("still serving")
        assert notifier.stopping("stopping")
        notifier.close()
        inbox.wait_for("three notifications", lambda got: len(got) == 3)
    assert {d.sender_pid for d in inbox.received} == {os.getpid()}
    fields = [notify_fields(d.data) for d in inbox.received]
    assert fields == [
        {"READY": "1", "STATUS": "serving"},
        {"STATUS": "still serving"},
        {"STOPPING": "1", "STATUS": "stopping"},
    ]


def test_a_missing_socket_is_logged_never_raised(tmp_path: Path) -> None:
    notifier = ServiceNotifier(NotifySettings(str(tmp_path / "gone.sock")))
    assert not notifier.ready("ready")
    assert not notifier.watchdog()


async def test_the_watchdog_loop_pings_until_cancelled(tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    with DatagramInbox(path) as inbox:
        notifier = ServiceNotifier(NotifySettings(path, 0.05))
        with trio.move_on_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(notifier.keep_watchdog)
                while len(inbox.received) < 4:
                    await trio.sleep(0.01)
                nursery.cancel_scope.cancel()
        assert len(inbox.received) >= 4
        assert {d.data for d in inbox.received} == {b"WATCHDOG=1\n"}
        # Paced by the interval, not a busy loop: four pings take at least three intervals.
        first, fourth = inbox.received[0].at_monotonic, inbox.received[3].at_monotonic
        assert fourth - first >= 0.14


async def test_no_watchdog_asked_means_the_loop_returns_at_once() -> None:
    with trio.fail_after(5):
        await ServiceNotifier(NotifySettings("@x", None)).keep_watchdog()


def test_the_agents_status_line_says_what_it_waits_for() -> None:
    status = Status(1, "node-1", "coord:7444", 0)
    assert service_status(status) == "not connected to coord:7444, retrying (0 reconnects)"
    status.connected = True
    assert service_status(status) == "connected to coord:7444"
    status.safe_mode = True
    assert service_status(status).startswith("SAFE MODE")


class _DaemonStatus:
    """The parts of a Daemon that telling the service manager reads: readiness, the status
    and the watchers its status loop calls after each status.json write."""

    def __init__(self) -> None:
        self.ready = trio.Event()
        self.status = Status(1, "node-1", "coord:7444", 0)
        self.status_watchers: list[Callable[[], None]] = []


async def test_without_systemd_the_status_line_costs_no_loop_at_all() -> None:
    daemon = _DaemonStatus()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_tell_service_manager, cast(Daemon, daemon), ServiceNotifier())
            daemon.ready.set()
    # It returned once ready: nothing wakes every second for a socket that is not there.
    assert daemon.status_watchers == []


async def test_the_status_line_is_sent_when_it_changes_after_a_status_write() -> None:
    name = f"@tuneplane-test-{uuid.uuid4().hex}"
    daemon = _DaemonStatus()
    with DatagramInbox(name) as inbox:
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    _tell_service_manager,
                    cast(Daemon, daemon),
                    ServiceNotifier(NotifySettings(name)),
                )
                daemon.ready.set()
        inbox.wait_for("READY", lambda got: len(got) == 1)
        (watcher,) = daemon.status_watchers
        watcher()  # unchanged: nothing sent
        daemon.status.connected = True
        watcher()
        watcher()  # sent once per change
        inbox.wait_for("the connected status", lambda got: len(got) == 2)
    assert [notify_fields(d.data) for d in inbox.received] == [
        {
            "READY": "1",
            "STATUS": "journal replayed; not connected to coord:7444, retrying (0 reconnects)",
        },
        {"STATUS": "connected to coord:7444"},
    ]
