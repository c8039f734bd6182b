"""Reports through the control-session core over generated interleavings of the shell's steps.

The model (agent/daemon_session.py's, with time as a value): the member manager journals a
report and publishes it within the publish grace, or never (it published before the session was
open); the session loop reads the journal and later ticks with what it read, one read at a time,
waking at the session's deadline at the latest; the coordinator acknowledges a report it got
(or not, for a while); time passes. Times are sums of powers of two, exact in floats.

Checked: every report goes out while the session is open within a heartbeat interval plus the
grace from when it was journaled (or the session opened), and one published while open and not
replayed at Welcome goes out first by that publish; no report goes out twice within a heartbeat
timeout, nor after its acknowledgement.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import pairwise

import attrs
from hypothesis import given
from hypothesis import strategies as st

from tuneplane.agent import messages as m
from tuneplane.agent.inventory import SimulatedGpus, simulated_inventory
from tuneplane.agent.journal_records import MemberKey, PendingReport
from tuneplane.agent.member_state import MemberState
from tuneplane.agent.session import ControlSession, Effect, Phase, Send
from tuneplane.agent.session_reports import REPORT_PUBLISH_GRACE_S as GRACE

INV = simulated_inventory("node-a", SimulatedGpus("h200", 1))
# An interval that does not divide the grace: a report waiting for it needs a wake-up of its own.
INTERVAL_S, TIMEOUT_S = 0.75, 3.0
WELCOME = m.Welcome(heartbeat_interval_ms=750, heartbeat_timeout_ms=3000, server_time_ms=0)


def report(seq: int) -> PendingReport:
    return PendingReport(seq, MemberKey("run-1", 1, 0), MemberState.RUNNING, seq, "", None, "/o")


@attrs.define
class Shell:
    """The daemon around one session: a journal, the session loop's read, the coordinator."""

    session: ControlSession = attrs.field(factory=lambda: ControlSession("node-1", "0.1.0"))
    now: float = 0.0
    opened_at: float | None = None
    made: dict[int, float] = attrs.field(factory=dict)  # report_seq -> when journaled
    journal: list[int] = attrs.field(factory=list)  # the pending reports
    unpublished: list[int] = attrs.field(factory=list)
    replayed: list[int] = attrs.field(factory=list)  # sent at Welcome
    published_at: dict[int, float] = attrs.field(factory=dict)  # published while open
    loop_read: list[PendingReport] | None = None  # the session loop's read, not ticked with yet
    sends: dict[int, list[float]] = attrs.field(factory=lambda: defaultdict(list))
    acked_at: dict[int, float] = attrs.field(factory=dict)

    def pending(self) -> list[PendingReport]:
        return [report(seq) for seq in self.journal]

    def run(self, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, Send) and isinstance(effect.message, m.Report):
                self.sends[effect.message.report.report_seq].append(self.now)
            if isinstance(effect, Send) and isinstance(effect.message, m.Heartbeat):
                self.run(self.session.receive(self.now, m.HeartbeatAck(effect.message.seq)))

    def commit(self) -> None:
        seq = len(self.made) + 1
        self.made[seq] = self.now
        self.journal.append(seq)
        self.unpublished.append(seq)

    def publish(self, which: int) -> None:
        # The manager publishes right after journaling: within the grace, or never.
        timely = [s for s in self.unpublished if self.now - self.made[s] < GRACE]
        if timely:
            seq = timely[which % len(timely)]
            self.unpublished.remove(seq)
            if self.opened_at is not None:
                self.published_at[seq] = self.now
            self.run(self.session.outgoing(m.Report(report(seq)), self.now))

    def welcome(self, missed: int) -> None:
        # The Welcome's read may predate the last ``missed`` reports journaled.
        seen = self.journal[: max(len(self.journal) - missed, 0)]
        self.replayed = seen
        self.run(self.session.receive(self.now, WELCOME, [report(s) for s in seen]))
        self.opened_at = self.now

    def read(self) -> None:
        if self.loop_read is None:
            self.loop_read = self.pending()

    def tick(self) -> None:
        if self.loop_read is not None:
            read, self.loop_read = self.loop_read, None
            self.run(self.session.tick(self.now, 0, INV, read))

    def ack(self, which: int) -> None:
        received = [s for s in self.sends if s in self.journal]
        if received:
            seq = received[which % len(received)]
            self.run(self.session.receive(self.now, m.ReportAck(seq)))
            self.journal.remove(seq)
            self.acked_at[seq] = self.now

    def wait(self, seconds: float) -> None:
        """Time passes; the loop wakes at every deadline: it finishes the tick it was in, then
        reads again and ticks."""
        until = self.now + seconds
        while (deadline := self.session.next_deadline()) <= until:
            self.now = max(self.now, deadline)
            self.tick()
            self.read()
            self.tick()
            assert self.session.next_deadline() > self.now, "the deadline did not move on"
        self.now = until

    def step(self, name: str, arg: float) -> None:
        if name == "commit":
            self.commit()
        elif name == "publish":
            self.publish(int(arg))
        elif name == "read":
            self.read()
        elif name == "tick":
            self.tick()
        elif name == "ack":
            self.ack(int(arg))
        else:
            self.wait(arg)


STEP = st.one_of(
    st.just(("commit", 0)),
    st.tuples(st.just("publish"), st.integers(0, 3)),
    st.just(("read", 0)),
    st.just(("tick", 0)),
    st.tuples(st.just("ack"), st.integers(0, 3)),
    st.tuples(st.just("wait"), st.sampled_from([0.0625, 0.25, 0.5, 1.0, 2.0, 4.0])),
)
BEFORE = st.one_of(st.just(("commit", 0)), st.tuples(st.just("publish"), st.integers(0, 3)))


@given(st.lists(BEFORE, max_size=4), st.integers(0, 2), st.lists(STEP, max_size=40))
def test_every_report_goes_out_in_time_and_never_twice_within_the_timeout(
    before: list[tuple[str, float]], missed: int, steps: list[tuple[str, float]]
) -> None:
    shell = Shell()
    shell.session.start(0.0, INV, [])
    for name, arg in before:
        shell.step(name, arg)
    shell.welcome(missed)
    for name, arg in steps:
        shell.step(name, arg)
    shell.wait(INTERVAL_S + GRACE)
    assert shell.session.phase is Phase.OPEN and shell.opened_at is not None
    for seq, journaled in shell.made.items():
        times = shell.sends[seq]
        due = max(journaled, shell.opened_at) + INTERVAL_S + GRACE
        assert times and times[0] <= due, f"report {seq} sent at {times}, due by {due}"
        assert all(b - a >= TIMEOUT_S for a, b in pairwise(times)), (seq, times)
        if seq in shell.published_at and seq not in shell.replayed:
            # Published in time: that publish sent it, not a tick's read racing it (issue 13).
            assert times[0] == shell.published_at[seq], (seq, times, shell.published_at[seq])
        if seq in shell.acked_at:
            assert times[-1] <= shell.acked_at[seq], (seq, times, shell.acked_at[seq])
