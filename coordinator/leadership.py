"""Which coordinator leads: the lease rules, pure (no clock, no I/O).

Rules (docs/operator.md, "Running two or three coordinators"):
- Coordinators sharing one PostgreSQL store compete for one lease row. The holder leads: it
  alone listens, admits, places and writes. The lease has a **term** that grows by one at every
  takeover; every write transaction of the leader checks that the term is still its own
  (fencing), so a leader that was paused or cut off and lost the lease can never write again,
  whatever its clock says.
- The lease lasts :attr:`LeaseSettings.ttl_s`, measured by the database's clock (never the
  coordinators' own, which may disagree). The leader renews it every
  :attr:`LeaseSettings.renew_s`.
- A standby reads the lease every :attr:`LeaseSettings.poll_s` and takes over when the lease
  expired (the leader stopped renewing: paused, cut off, hung) or at once when the leader's
  database session is gone (its process died: the kernel closed its connections, so PostgreSQL
  ended its session). Taking over waits for the old leader's write transactions in flight; they
  either committed before the term moved or fail its fence.
- A leader that cannot renew steps down by itself before its lease can have expired anywhere:
  at ``renewed_at + ttl_s - margin_s`` on its own monotonic clock (:func:`must_step_down_at`),
  counted from when the last successful renewal *started*.
"""

from __future__ import annotations

import enum

import attrs


class LeaseSettingsError(ValueError):
    """Lease timings that cannot work together; ``str()`` names the setting."""


@attrs.frozen
class LeaseSettings:
    """The lease's timings, in seconds (coordinator.toml ``[leader]``)."""

    # Ten seconds: long enough that a leader whose event loop is saturated (thousands of Nodes
    # reconnecting at once) still renews in time; a killed leader is replaced at the next poll
    # anyway, by its vanished session.
    ttl_s: float = 10.0
    renew_s: float = 1.0
    poll_s: float = 0.5

    def __attrs_post_init__(self) -> None:
        for name in ("ttl_s", "renew_s", "poll_s"):
            if not getattr(self, name) > 0:
                raise LeaseSettingsError(
                    f"[leader] {name.removesuffix('_s')}_s must be a positive number of seconds "
                    f"(got {getattr(self, name)!r})."
                )
        if self.renew_s * 2 > self.ttl_s:
            raise LeaseSettingsError(
                f"[leader] renew_s ({self.renew_s:g}) must be at most half of ttl_s "
                f"({self.ttl_s:g}), so one missed renewal does not end the lease. Lower renew_s "
                "or raise ttl_s."
            )

    @property
    def margin_s(self) -> float:
        """How long before its lease could expire a leader that cannot renew steps down."""
        return min(self.renew_s, self.ttl_s / 4)

    @property
    def ttl_ms(self) -> int:
        return int(self.ttl_s * 1000)


@attrs.frozen
class LeaseRow:
    """The lease as read from the store. ``now_ms`` is the database's clock at that read.

    ``holder_alive`` is whether the database session that holds the lease still exists.
    """

    term: int
    holder: str
    acquired_ms: int
    expires_ms: int
    now_ms: int
    holder_alive: bool


class Verdict(enum.Enum):
    """What a standby does after reading the lease."""

    TAKE_OVER = "take over"
    WAIT = "wait"


@attrs.frozen
class Reading:
    """A standby's verdict and why, as the decision log and its own log say it."""

    verdict: Verdict
    why: str


def judge(lease: LeaseRow | None) -> Reading:
    """Whether a standby takes the lease it just read (None: nobody ever held one). A lease
    that names this very coordinator (a restart that kept its id) is judged like any other:
    by its session and its expiry."""
    if lease is None:
        return Reading(Verdict.TAKE_OVER, "no coordinator has led this store before")
    if not lease.holder_alive:
        return Reading(
            Verdict.TAKE_OVER,
            f"the leader {lease.holder}'s database session ended (its process stopped or lost "
            "its connection)",
        )
    if lease.expires_ms <= lease.now_ms:
        late_s = (lease.now_ms - lease.expires_ms) / 1000
        return Reading(
            Verdict.TAKE_OVER,
            f"the leader {lease.holder} did not renew its lease (expired {late_s:.1f} s ago)",
        )
    return Reading(Verdict.WAIT, f"{lease.holder} leads (term {lease.term})")


def must_step_down_at(renew_started: float, settings: LeaseSettings) -> float:
    """The monotonic time by which a leader whose last successful renewal started at
    ``renew_started`` stops acting, unless another renewal succeeds first."""
    return renew_started + settings.ttl_s - settings.margin_s


__all__ = [
    "LeaseRow",
    "LeaseSettings",
    "LeaseSettingsError",
    "Reading",
    "Verdict",
    "judge",
    "must_step_down_at",
]
