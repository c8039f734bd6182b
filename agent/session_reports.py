"""Which unacknowledged reports a control session sends, and when (sans-IO, for agent/session.py).

Rules:
- A report goes out on a stream at Welcome (every pending one, oldest first), when the member
  manager publishes it, or from a tick's journal read; once sent, it goes again only after a
  heartbeat timeout without its ReportAck.
- A report a tick's read shows that this session has not sent is one the member manager
  journaled and is about to publish (the read ran between the two): the tick waits
  :data:`REPORT_PUBLISH_GRACE_S` from first seeing it and sends it then only if it is still
  unsent. Sending it at once sent it twice, the tick's copy and the publish's (issue 13: one
  report in five of a launch). One the manager could not publish (it did so before Welcome,
  after the Welcome's journal read) still goes out, a grace later.
- A publish of a report this stream carried within the timeout (at Welcome, or a tick's after
  the grace) is not sent again.
- An acknowledged report is not sent again: not by a read taken before the acknowledgement was
  journaled (which still shows it), nor by a publish that comes after it. That is remembered for
  a heartbeat timeout, far longer than either takes.
- The member manager publishes a report right after journaling it, within the grace: that is
  what the grace waits for.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from .journal_records import PendingReport

#: How long a report first seen in a tick's journal read waits for the member manager's publish.
REPORT_PUBLISH_GRACE_S = 1.0


def _in_order(pending: Sequence[PendingReport]) -> list[PendingReport]:
    return sorted(pending, key=lambda r: r.report_seq)


@attrs.define
class ReportBook:
    """One session's bookkeeping of the reports it sent and those it saw unsent."""

    # report_seq -> when it was last sent on this stream (monotonic seconds).
    sent_at: dict[int, float] = attrs.field(factory=dict)
    # report_seq -> when a tick's read first showed it unsent (awaiting the manager's publish).
    seen_at: dict[int, float] = attrs.field(factory=dict)
    # report_seq -> when the coordinator acknowledged it (kept a heartbeat timeout).
    acked_at: dict[int, float] = attrs.field(factory=dict)

    def replay(self, now: float, pending: Sequence[PendingReport]) -> list[PendingReport]:
        """At Welcome: every pending report, oldest first, is sent now."""
        ordered = _in_order(pending)
        for report in ordered:
            self._sent(report.report_seq, now)
        return ordered

    def publish(self, report_seq: int, now: float, timeout_s: float) -> bool:
        """The member manager publishes this report: whether to send it (not when this stream
        carried it within ``timeout_s``, e.g. at Welcome or after a grace)."""
        sent = self.sent_at.get(report_seq)
        if report_seq in self.acked_at or (sent is not None and now - sent < timeout_s):
            return False
        self._sent(report_seq, now)
        return True

    def acked(self, report_seq: int, now: float) -> None:
        self.sent_at.pop(report_seq, None)
        self.seen_at.pop(report_seq, None)
        self.acked_at[report_seq] = now

    def due(
        self, now: float, pending: Sequence[PendingReport], timeout_s: float
    ) -> list[PendingReport]:
        """Of ``pending`` (a tick's journal read), those to send now, oldest first."""
        for seq in [seq for seq, at in self.acked_at.items() if now - at >= timeout_s]:
            del self.acked_at[seq]
        listed = {report.report_seq for report in pending}
        for seq in [seq for seq in self.seen_at if seq not in listed]:
            del self.seen_at[seq]  # gone from the journal: nothing to wait for
        due: list[PendingReport] = []
        for report in _in_order(pending):
            seq = report.report_seq
            sent = self.sent_at.get(seq)
            if seq in self.acked_at:
                continue  # a read from before its acknowledgement was journaled
            if sent is None:
                if now - self.seen_at.setdefault(seq, now) < REPORT_PUBLISH_GRACE_S:
                    continue
            elif now - sent < timeout_s:
                continue
            self._sent(seq, now)
            due.append(report)
        return due

    def next_deadline(self) -> float:
        """When the earliest report seen unsent is due (inf: none is waiting). A resend after
        the timeout needs no deadline of its own: a heartbeat's tick comes first (interval <
        timeout)."""
        return min(self.seen_at.values(), default=float("inf")) + REPORT_PUBLISH_GRACE_S

    def _sent(self, report_seq: int, now: float) -> None:
        self.sent_at[report_seq] = now
        self.seen_at.pop(report_seq, None)
