"""The control-session core, driven with plain values for time (no sockets, no clocks)."""

from __future__ import annotations

import pytest

from tuneplane.agent import messages as m
from tuneplane.agent.inventory import SimulatedGpus, simulated_inventory
from tuneplane.agent.journal_records import MemberKey, PendingReport
from tuneplane.agent.member_state import MemberState
from tuneplane.agent.session import (
    AdoptCoordinators,
    Close,
    Connected,
    ControlSession,
    DropReport,
    HandleCommand,
    HeartbeatAcked,
    Send,
    SessionError,
    WaitingInLine,
)
from tuneplane.agent.session_reports import REPORT_PUBLISH_GRACE_S as GRACE
from tuneplane.proto.contract import control_protocol as protocol

INV = simulated_inventory("node-a", SimulatedGpus("h200", 2))
KEY = MemberKey("run-1", 1, 0)
WELCOME = m.Welcome(
    heartbeat_interval_ms=500,
    heartbeat_timeout_ms=3000,
    server_time_ms=0,
    coordinator_version="9.9.0",
    protocol=protocol.PROTOCOL,
    capabilities=protocol.COORDINATOR_CAPABILITIES,
)
COORDINATOR = protocol.Peer(
    "9.9.0", protocol.PROTOCOL, frozenset(protocol.COORDINATOR_CAPABILITIES)
)


def report(seq: int) -> PendingReport:
    return PendingReport(seq, KEY, MemberState.RUNNING, 1, "", None, "/o")


def opened(now: float = 0.0) -> ControlSession:
    s = ControlSession("node-1", "0.1.0")
    s.start(now, INV, [])
    s.receive(now, WELCOME)
    return s


def test_hello_carries_inventory_and_held_members() -> None:
    s = ControlSession("node-1", "0.1.0")
    (effect,) = s.start(0.0, INV, [(KEY, MemberState.PREPARED)])
    assert effect == Send(
        m.Hello(
            "node-1",
            "0.1.0",
            INV,
            ((KEY, MemberState.PREPARED),),
            protocol=protocol.PROTOCOL,
            capabilities=protocol.AGENT_CAPABILITIES,
        )
    )
    with pytest.raises(SessionError):
        s.start(0.0, INV, [])


def test_welcome_replays_reports_in_order_then_asks_for_decisions() -> None:
    s = ControlSession("node-1", "0.1.0")
    s.start(0.0, INV, [])
    other = MemberKey("run-2", 1, 0)
    effects = s.receive(1.0, WELCOME, pending=[report(7), report(3)], undecided=[other])
    assert effects == [
        Connected(0.5, 3.0, coordinator=COORDINATOR),
        AdoptCoordinators(()),
        Send(m.Report(report(3))),
        Send(m.Report(report(7))),
        Send(m.DecisionQuery(other)),
    ]
    # A second Welcome replays nothing.
    assert s.receive(1.1, WELCOME, pending=[report(3)]) == [AdoptCoordinators(())]


def test_anything_before_welcome_closes() -> None:
    s = ControlSession("node-1", "0.1.0")
    s.start(0.0, INV, [])
    (effect,) = s.receive(0.1, m.HeartbeatAck(1))
    assert isinstance(effect, Close) and "before Welcome" in effect.reason
    assert s.receive(0.2, WELCOME) == []


def test_no_welcome_within_the_first_timeout_closes() -> None:
    s = ControlSession("node-1", "0.1.0")
    s.start(100.0, INV, [])
    assert s.next_deadline() == 110.0
    assert s.tick(109.9, 0, INV) == []
    (effect,) = s.tick(110.0, 0, INV)
    assert isinstance(effect, Close) and "Welcome" in effect.reason


def test_a_place_in_line_waits_for_the_welcome_twice_the_wait_said_and_no_longer() -> None:
    s = ControlSession("node-1", "0.1.0")
    s.start(100.0, INV, [])
    sentence = "the coordinator is welcoming 256 Nodes with 900 waiting"
    assert s.receive(100.5, m.Queued(20.0, sentence)) == [WaitingInLine(20.0, 50.0, sentence)]
    # Past the usual 10 s, still waiting; 2 x 20 s + 10 s after the place was given, closed.
    assert s.next_deadline() == 150.5
    assert s.tick(150.4, 0, INV) == []
    (effect,) = s.tick(150.5, 0, INV)
    assert isinstance(effect, Close) and "no Welcome" in effect.reason


def test_a_place_in_line_is_waited_for_at_most_the_cap_and_means_nothing_once_open() -> None:
    s = ControlSession("node-1", "0.1.0")
    s.start(0.0, INV, [])
    (waiting,) = s.receive(0.0, m.Queued(10_000.0, "busy"))
    assert isinstance(waiting, WaitingInLine) and waiting.deadline_s == protocol.QUEUED_CAP_S
    s.receive(1.0, WELCOME)
    assert s.receive(1.1, m.Queued(5.0, "busy")) == []
    assert s.heartbeat_timeout_s == 3.0


def test_heartbeats_every_interval_with_inventory_only_when_changed() -> None:
    s = opened(0.0)
    assert s.next_deadline() == 0.5
    assert s.tick(0.4, 0, INV) == []
    assert s.tick(0.5, 500, INV) == [Send(m.Heartbeat(1, 500, None))]
    s.receive(0.6, m.HeartbeatAck(1))
    changed = simulated_inventory("node-a", SimulatedGpus("h200", 1))
    assert s.tick(1.0, 1000, changed) == [Send(m.Heartbeat(2, 1000, changed))]
    s.receive(1.1, m.HeartbeatAck(2))
    assert s.tick(1.5, 1500, changed) == [Send(m.Heartbeat(3, 1500, None))]


def test_a_stalled_loop_sends_one_heartbeat_not_a_burst() -> None:
    s = opened(0.0)
    s.receive(2.0, m.HeartbeatAck(0))
    assert len(s.tick(2.4, 0, INV)) == 1
    assert s.tick(2.45, 0, INV) == []


def test_a_silent_peer_closes_after_the_timeout() -> None:
    s = opened(0.0)
    s.tick(0.5, 0, INV)
    s.receive(1.0, m.HeartbeatAck(1))
    assert s.next_deadline() == 1.0  # the next beat is due before the silence limit
    s.tick(1.0, 0, INV)
    s.tick(1.5, 0, INV)
    assert s.next_deadline() == 2.0
    assert not any(isinstance(e, Close) for e in s.tick(3.9, 0, INV))
    (effect,) = s.tick(4.0, 0, INV)
    assert isinstance(effect, Close) and "3.0 s" in effect.reason
    assert s.tick(5.0, 0, INV) == [] and s.next_deadline() == float("inf")


def test_acks_and_commands_become_effects() -> None:
    s = opened(0.0)
    assert s.receive(0.1, m.HeartbeatAck(4)) == [HeartbeatAcked(4)]
    assert s.receive(0.1, m.ReportAck(9)) == [DropReport(9)]
    abort = m.Abort(KEY, "another member refused")
    assert s.receive(0.1, abort) == [HandleCommand(abort)]


def test_outgoing_is_sent_only_while_open() -> None:
    s = ControlSession("node-1", "0.1.0")
    reply = m.PrepareReply(KEY, True, "", None)
    assert s.outgoing(reply) == []
    s.start(0.0, INV, [])
    assert s.outgoing(reply) == []
    s.receive(0.0, WELCOME)
    assert s.outgoing(reply) == [Send(reply)]
    assert isinstance(s.stream_ended()[0], Close)
    assert s.outgoing(reply) == []


def test_zero_timings_get_floors_instead_of_a_busy_loop() -> None:
    s = ControlSession("node-1", "0.1.0")
    s.start(0.0, INV, [])
    connected, _coordinators = s.receive(0.0, m.Welcome(0, 0, 0, protocol=protocol.PROTOCOL))
    assert connected == Connected(
        0.05, 0.1, coordinator=protocol.Peer("unknown", protocol.PROTOCOL)
    )


def test_every_welcome_names_the_coordinators_for_the_shell_to_store() -> None:
    s = ControlSession("node-1", "0.1.0")
    s.start(0.0, INV, [])
    both = ("b:7444", "a:7444")
    first = s.receive(0.0, m.Welcome(500, 3000, 0, coordinators=both))
    assert AdoptCoordinators(both) in first
    # A repeated Welcome names them again (the shell keeps a stored list an empty one meets).
    assert s.receive(1.0, m.Welcome(500, 3000, 0)) == [AdoptCoordinators(())]


def test_unacknowledged_reports_are_resent_and_missed_ones_caught_up() -> None:
    s = opened(0.0)
    s.tick(0.5, 0, INV)
    # Report 1 went out through outgoing(); report 2 was written while the stream opened and
    # never went out: it goes once the manager had its grace to publish it, report 1 does not.
    s.outgoing(m.Report(report(1)), now=0.6)
    assert s.tick(1.0, 0, INV, pending=[report(1), report(2)]) == [Send(m.Heartbeat(2, 0, None))]
    effects = s.tick(1.0 + GRACE, 0, INV, pending=[report(1), report(2)])
    assert Send(m.Report(report(2))) in effects and Send(m.Report(report(1))) not in effects
    s.receive(2.1, m.ReportAck(2))
    s.receive(3.5, m.HeartbeatAck(1))
    # After a heartbeat timeout without an ack, report 1 goes again.
    effects = s.tick(3.6, 0, INV, pending=[report(1)])
    assert Send(m.Report(report(1))) in effects


def test_a_report_read_from_the_journal_before_its_publish_goes_out_once() -> None:
    """Issue 13: a Commit both reaches the member manager and wakes the tick, whose journal read
    sees the report the manager has just journaled but not yet published. Only the publish
    sends it; neither a later tick nor a read from before its ack sends it again."""
    s = opened(0.0)
    assert s.tick(0.1, 0, INV, pending=[report(1)]) == []
    assert s.outgoing(m.Report(report(1)), now=0.1) == [Send(m.Report(report(1)))]
    assert s.tick(0.1 + GRACE, 0, INV, pending=[report(1)]) == [Send(m.Heartbeat(1, 0, None))]
    assert s.receive(1.2, m.ReportAck(1)) == [DropReport(1)]
    assert s.tick(1.2, 0, INV, pending=[report(1)]) == []
    assert s.tick(1.2 + GRACE, 0, INV, pending=[report(1)]) == [Send(m.Heartbeat(2, 0, None))]


def test_a_report_the_manager_could_not_publish_goes_a_grace_after_a_tick_saw_it() -> None:
    """Published before Welcome and missed by the Welcome's read: the tick that wakes for the
    grace sends it (a heartbeat interval longer than the grace shows the wake-up)."""
    s = ControlSession("node-1", "0.1.0")
    s.start(0.0, INV, [])
    assert s.outgoing(m.Report(report(4))) == []
    s.receive(0.0, m.Welcome(4000, 12000, 0))
    assert s.tick(0.25, 0, INV, pending=[report(4)]) == []
    assert s.next_deadline() == 0.25 + GRACE
    assert s.tick(0.25 + GRACE, 0, INV, pending=[report(4)]) == [Send(m.Report(report(4)))]
    assert s.next_deadline() == 4.0
    # Published at last: the stream carried it a moment ago.
    assert s.outgoing(m.Report(report(4)), now=1.5) == []


def test_a_report_replayed_at_welcome_is_not_published_again() -> None:
    s = ControlSession("node-1", "0.1.0")
    s.start(0.0, INV, [])
    s.receive(1.0, WELCOME, pending=[report(5)])
    assert s.outgoing(m.Report(report(5)), now=1.0) == []
    s.receive(1.1, m.ReportAck(5))
    assert s.outgoing(m.Report(report(5)), now=1.2) == []


def test_welcome_says_who_the_coordinator_is_and_an_older_one_is_warned_of() -> None:
    """A current coordinator is recorded as it said; an unversioned one (0.1.x) is protocol 1,
    outside the policy for this agent: the session goes on, with a warning naming both."""
    s = ControlSession("node-1", "0.2.0")
    s.start(0.0, INV, [])
    (connected, _) = s.receive(0.1, WELCOME)
    assert connected == Connected(0.5, 3.0, coordinator=COORDINATOR)
    old = ControlSession("node-1", "0.2.0")
    old.start(0.0, INV, [])
    unversioned = m.Welcome(heartbeat_interval_ms=500, heartbeat_timeout_ms=3000, server_time_ms=0)
    (connected, _) = old.receive(0.1, unversioned)
    assert isinstance(connected, Connected)
    assert connected.coordinator == protocol.Peer("unknown", 1)
    assert "control protocol 1" in connected.skew_warning
    assert (
        "0.2.0" in connected.skew_warning and "upgrade the coordinators" in connected.skew_warning
    )
    assert old.phase.value == "open"


def test_a_coordinators_update_mid_session_is_stored_like_welcomes() -> None:
    s = opened()
    update = m.Coordinators(("a:1", "b:2"))
    assert s.receive(1.0, update) == [AdoptCoordinators(("a:1", "b:2"))]
    assert s.receive(1.1, m.Coordinators(())) == [AdoptCoordinators(())]


def test_prepare_progress_goes_only_to_a_coordinator_that_announced_it() -> None:
    progress = m.PrepareProgress(KEY, "image:r.example/x@sha256:" + "0" * 64, 1, 2, 0, 1, "pulling")
    assert opened().outgoing(progress) == [Send(progress)]
    older = ControlSession("node-1", "0.1.0")
    older.start(0.0, INV, [])
    announced = tuple(
        c for c in protocol.COORDINATOR_CAPABILITIES if c != protocol.Capability.PREPARE_PROGRESS
    )
    older.receive(0.0, m.Welcome(500, 3000, 0, protocol=protocol.PROTOCOL, capabilities=announced))
    assert older.outgoing(progress) == []
    # What Prepare answers still goes: the coordinator waits for it.
    reply = m.PrepareReply(KEY, True, "", None)
    assert older.outgoing(reply) == [Send(reply)]
