"""The runner's decisions as a state machine (sans-IO: no processes, no signals, no clock).

Theory of operation: the member is RUNNING until a local process fails or a stop is requested;
then it is STOPPING: the survivors get SIGTERM (``Terminate``), and when the grace period the shell
timed runs out, SIGKILL (``Kill``). When the last process has exited the member is FINISHED and
the single ``Finish`` effect carries its result: the first failure's exit code or signal, else 0.
Transitions are the table ``_TRANSITIONS``; a move not in it raises :class:`IllegalTransition`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable

from .records import ProcessResult


class Phase(enum.Enum):
    RUNNING = "running"
    STOPPING = "stopping"
    FINISHED = "finished"


@dataclasses.dataclass(frozen=True)
class ProcessExited:
    """A local process ended (``error`` set when it could not even be started)."""

    local_rank: int
    exit_code: int | None
    signal: int | None
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class StopRequested:
    """Someone (the agent, via SIGTERM to the runner) asked the member to stop."""

    reason: str


@dataclasses.dataclass(frozen=True)
class GraceExpired:
    """The grace period armed by the last ``Terminate`` has run out."""


Event = ProcessExited | StopRequested | GraceExpired


@dataclasses.dataclass(frozen=True)
class Terminate:
    """SIGTERM these local processes' groups, then arm the grace timer."""

    local_ranks: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Kill:
    """SIGKILL these local processes' groups."""

    local_ranks: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Finish:
    """Every local process has ended; record this result."""

    exit_code: int | None
    signal: int | None
    stop_reason: str | None
    processes: tuple[ProcessResult, ...]


Effect = Terminate | Kill | Finish


class IllegalTransition(RuntimeError):
    """An event arrived that the current phase cannot accept (a bug in the shell)."""


def _failed(event: ProcessExited) -> bool:
    return event.exit_code != 0 or event.signal is not None


class MemberLifecycle:
    """Feed events with :meth:`handle`; carry out the returned effects in order."""

    def __init__(self, local_ranks: Iterable[int]) -> None:
        self.phase = Phase.RUNNING
        self.running: list[int] = list(local_ranks)
        if not self.running:
            raise ValueError("a member has at least one local process")
        self.results: dict[int, ProcessResult] = {}
        self.first_failure: ProcessResult | None = None
        self.stop_reason: str | None = None
        self._order = tuple(self.running)

    def handle(self, event: Event) -> list[Effect]:
        step = _TRANSITIONS.get((self.phase, type(event)))
        if step is None:
            raise IllegalTransition(
                f"event {type(event).__name__} is not accepted while the member is "
                f"{self.phase.value}"
            )
        return step(self, event)

    def _record(self, event: Event) -> None:
        assert isinstance(event, ProcessExited)
        if event.local_rank not in self.running:
            raise IllegalTransition(
                f"local rank {event.local_rank} exited but it is not running "
                f"(running: {self.running})"
            )
        self.running.remove(event.local_rank)
        result = ProcessResult(event.local_rank, event.exit_code, event.signal, event.error)
        self.results[event.local_rank] = result
        if self.first_failure is None and _failed(event):
            self.first_failure = result

    def _finish(self) -> list[Effect]:
        self.phase = Phase.FINISHED
        processes = tuple(self.results[rank] for rank in self._order)
        first = self.first_failure
        if first is None:
            return [Finish(0, None, self.stop_reason, processes)]
        return [Finish(first.exit_code, first.signal, self.stop_reason, processes)]

    def _stop(self, reason: str) -> list[Effect]:
        self.phase = Phase.STOPPING
        self.stop_reason = reason
        if not self.running:
            return self._finish()
        return [Terminate(tuple(self.running))]

    def _exited_while_running(self, event: Event) -> list[Effect]:
        self._record(event)
        assert isinstance(event, ProcessExited)
        if _failed(event):
            return self._stop(f"local rank {event.local_rank} failed")
        return [] if self.running else self._finish()

    def _stop_requested(self, event: Event) -> list[Effect]:
        assert isinstance(event, StopRequested)
        return self._stop(event.reason)

    def _exited_while_stopping(self, event: Event) -> list[Effect]:
        self._record(event)
        return [] if self.running else self._finish()

    def _stop_again(self, event: Event) -> list[Effect]:
        # A repeated stop request neither restarts the grace period nor changes the reason.
        return []

    def _grace_expired(self, event: Event) -> list[Effect]:
        return [Kill(tuple(self.running))] if self.running else []


_Step = Callable[[MemberLifecycle, Event], list[Effect]]
_TRANSITIONS: dict[tuple[Phase, type], _Step] = {
    (Phase.RUNNING, ProcessExited): MemberLifecycle._exited_while_running,
    (Phase.RUNNING, StopRequested): MemberLifecycle._stop_requested,
    (Phase.STOPPING, ProcessExited): MemberLifecycle._exited_while_stopping,
    (Phase.STOPPING, StopRequested): MemberLifecycle._stop_again,
    (Phase.STOPPING, GraceExpired): MemberLifecycle._grace_expired,
}
