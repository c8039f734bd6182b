"""Which member of a failed Job failed first, and the last lines of its stderr.

Rules:
- "First" is by the time each member failed: for a member whose Node reported its end, the exit
  report's ``at_ms`` (the Node's clock, recorded as the member's ``ended_at_ms``); for a lost
  member, when its Node went silent (the coordinator's clock, the start of its trailing
  ``unknown``/``lost`` history), since it stopped working no later than that. Nodes' clocks are
  assumed to agree within the time a sibling takes to notice a failure (seconds).
- Ties on the same millisecond go to a workload's own failure (a non-zero exit code) before an
  end by a signal or a launch failure, before a lost member; then to the lowest member index. A
  failed member whose time is not known at all sorts after every one whose time is known.
- Only members that failed count: a zero exit, a member still running or cancelled is never
  chosen. The sentence saying what happened is :mod:`~tuneplane.coordinator.lifecycle`'s, the
  same one the Job's reason uses.
- Everything here is pure: :func:`culprit` names the member whose stderr to read, the caller
  reads it (``api/jobs.py``, from the log store) and :func:`first_failure` puts them together.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from . import lifecycle as lc
from .values.jobs import FirstFailure, Job, Member, MemberKey

#: At most this many lines of the failed member's stderr are shown ...
TAIL_LINES = 20
#: ... and at most this many bytes of them.
TAIL_BYTES = 4096

_NO_TIME = 2**63 - 1
_SILENT = frozenset({lc.M_UNKNOWN, lc.M_LOST})


@attrs.frozen
class MemberEnd:
    """What the choice needs of one member of the attempt."""

    index: int
    state: str
    has_exit: bool = False
    exit_code: int = 0
    signal: int = 0
    reason: str = ""  # why it is in its state (its latest history entry)
    ended_at_ms: int = 0  # the Node's exit report at_ms; 0 when no Node reported the end
    silent_since_ms: int = 0  # for a lost member: since when nothing was heard of it


@attrs.frozen
class Failed:
    """The chosen member: its index, when it failed (0: unknown) and a sentence saying how."""

    index: int
    at_ms: int
    what: str


def _what(m: MemberEnd) -> str | None:
    facts = lc.MemberFacts(m.index, m.state, m.has_exit, m.exit_code, m.signal, m.reason)
    return lc.failure_sentence(facts)


def _rank(m: MemberEnd) -> int:
    if m.state == lc.M_EXITED and not m.signal:
        return 0
    if m.state == lc.M_LOST:
        return 2
    return 1


def _when(m: MemberEnd) -> int:
    if m.state == lc.M_LOST:
        return m.ended_at_ms or m.silent_since_ms
    return m.ended_at_ms


def choose_first(members: Sequence[MemberEnd]) -> Failed | None:
    """The member that failed first (see the module's rules), or None when none failed."""
    failed = [(m, what) for m in members if (what := _what(m)) is not None]
    if not failed:
        return None
    m, what = min(
        failed, key=lambda pair: (_when(pair[0]) or _NO_TIME, _rank(pair[0]), pair[0].index)
    )
    return Failed(m.index, _when(m), what)


def member_end(view: Member) -> MemberEnd:
    """A stored member as :func:`choose_first` sees it."""
    silent = 0
    for change in reversed(view.history):
        if change.state not in _SILENT:
            break
        silent = change.at_ms
    reason = view.history[-1].reason if view.history else ""
    return MemberEnd(
        index=view.index,
        state=view.state,
        has_exit=view.has_exit,
        exit_code=view.exit_code,
        signal=view.signal,
        reason=reason,
        ended_at_ms=view.ended_at_ms,
        silent_since_ms=silent,
    )


def tail_lines(data: bytes, started_at_zero: bool) -> tuple[str, bool]:
    """The last :data:`TAIL_LINES` lines of ``data`` within :data:`TAIL_BYTES`, as text, and
    whether older output exists that they do not show. ``started_at_zero``: ``data`` begins at
    the stream's first byte (nothing before it was cut)."""
    cut = not started_at_zero
    if len(data) > TAIL_BYTES:
        data, cut = data[-TAIL_BYTES:], True
    lines = data.splitlines(keepends=True)
    if cut and lines:
        # The first line is only the end of a longer one: drop the fragment.
        lines = lines[1:]
    if len(lines) > TAIL_LINES:
        lines, cut = lines[-TAIL_LINES:], True
    return b"".join(lines).decode("utf-8", errors="replace"), cut


@attrs.frozen
class Culprit:
    """The member a failed Job's latest attempt failed first, and how."""

    key: MemberKey
    member: Member
    failed: Failed


def culprit(job: Job) -> Culprit | None:
    """For a failed Job: its latest attempt's first failed member; None otherwise."""
    if job.state != lc.FAILED or not job.attempts:
        return None
    attempt = job.attempts[-1]
    chosen = choose_first([member_end(m) for m in attempt.members])
    if chosen is None:
        return None
    member = next(m for m in attempt.members if m.index == chosen.index)
    return Culprit(MemberKey(job.run_id, attempt.number, member.index), member, chosen)


def first_failure(found: Culprit, stderr: bytes, from_start: bool) -> FirstFailure:
    """What ``tp job show`` says of ``found``, with the last lines of ``stderr`` (the end of
    the member's stored stderr, at most ``TAIL_BYTES + 1`` bytes; ``from_start`` when that is
    all of it)."""
    member, chosen = found.member, found.failed
    text, cut = tail_lines(stderr, from_start)
    return FirstFailure(
        attempt=found.key.attempt,
        member_index=member.index,
        node_id=member.node_id,
        state=member.state,
        has_exit=member.has_exit,
        exit_code=member.exit_code,
        signal=member.signal,
        at_ms=chosen.at_ms,
        what=chosen.what,
        stderr_tail=text,
        stderr_cut=cut,
    )
