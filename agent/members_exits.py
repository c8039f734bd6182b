"""A member's runner observed: started, running, exited or vanished, each journaled before it is
reported; a live member watched until it ends; a member stopped.

Rules: the artifact manifest is written before the exit is journaled, so a crash between the two
writes it again on replay (agent/outputs_manifest.py). An exit found when the agent restarted is
journaled with an ``exit-collected`` note in the same transaction; a live runner found again
is journaled as re-attached (pid and start time, never pid alone). Watchers are owned by the
daemon's nursery and end with their member.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import trio

from . import supervision
from .crashpoint import crashpoint
from .exit_wait import Waited, wait_exit
from .journal_records import (
    EXIT_COLLECTED,
    MEMBER_REATTACHED,
    Exit,
    ExtraEvent,
    MemberKey,
    MemberRecord,
)
from .member_state import TERMINAL, MemberEvent, MemberState
from .members_base import MemberBase, now_ms
from .outputs_manifest import write_manifest

log = logging.getLogger(__name__)

E = MemberEvent
S = MemberState
#: How often a live runner is looked at where no pidfd can tell its exit.
WATCH_INTERVAL_S = 0.25
#: How often a live runner whose exit a pidfd will tell is looked at all the same (the journal
#: may have ended the member some other way).
WATCH_CHECK_S = 5.0


class MemberExits(MemberBase):
    """Journal what supervision observes of a member's runner, watch it while it lives, stop it."""

    async def apply(
        self, key: MemberKey, observation: supervision.Observation, *, after_restart: bool = False
    ) -> None:
        """Journal what supervision observed, then keep watching a member that is still live.

        ``after_restart``: the observation is the first after the agent (re)started, so an exit
        is one that happened while the agent was down: an ``exit-collected`` event says so.
        """
        record = await self.journal.member(key)
        if record is None or record.state in TERMINAL:
            return
        report = None
        if isinstance(observation, supervision.Running):
            if record.state is S.STARTING:
                _, report = await self.journal.transition(
                    key, E.RUNNER_STARTED, now_ms(),
                    details={"runner_pid": observation.pid},
                )  # fmt: skip
        elif isinstance(observation, supervision.Exited):
            if record.state is S.STARTING:
                # An exit record means the runner did start the workload (which finished before
                # the agent looked): say it ran, so the history reads as what happened.
                _, started = await self.journal.transition(key, E.RUNNER_STARTED, now_ms())
                await self.report(started)
            exit = Exit(observation.exit_code, observation.signal)
            how = f"exit code {exit.exit_code}" if exit.signal is None else f"signal {exit.signal}"
            # The artifact manifest is written before the exit is journaled: a crash between
            # the two writes it again on replay (agent/outputs_manifest.py).
            manifest = await trio.to_thread.run_sync(
                write_manifest, Path(record.out_dir), key.run_id, key.attempt, key.member_index
            )
            log.info("output manifest member=%s files=%d bytes=%d sha256=%s problem=%s", key,
                     manifest.files, manifest.bytes, manifest.sha256, manifest.problem)  # fmt: skip
            _, report = await self.journal.transition(
                key, E.EXIT_OBSERVED, now_ms(), exit=exit, reason=how,
                extra=_collected(observation, how) if after_restart else None,
                manifest=manifest.to_json(),
            )  # fmt: skip
            log.info("member exited member=%s exit_code=%s signal=%s", key, exit.exit_code,
                     exit.signal)  # fmt: skip
            crashpoint("after-exit-observed")
        else:
            why = (
                observation.reason
                if isinstance(observation, supervision.Vanished)
                else "the runner left no record of starting"
            )
            _, report = await self.journal.transition(
                key, E.RUNNER_VANISHED, now_ms(), reason=f"member lost: {why}"
            )
            log.error("member lost member=%s reason=%s", key, why)
        await self.report(report)
        if isinstance(observation, supervision.Running):
            self._watch(key)

    def _watch(self, key: MemberKey) -> None:
        if key not in self.watched:
            self.watched.add(key)
            self.nursery.start_soon(self._watch_member, key)

    async def _watch_member(self, key: MemberKey) -> None:
        """Watch the runner until the member ends: woken by its exit (a pidfd), and every
        :data:`WATCH_CHECK_S` whatever happens; polled every :data:`WATCH_INTERVAL_S` where no
        pidfd can be had. Each look is cheap: a journal read, a few stats and a JSON read."""
        try:
            while True:
                record = await self.journal.member(key)
                if record is None or record.state not in (S.RUNNING, S.CANCELLING, S.STARTING):
                    return
                observation = supervision.observe(Path(record.member_dir))
                if not isinstance(observation, supervision.Running):
                    await self.apply(key, observation)
                    return
                waited = await wait_exit(observation.pid, observation.start_time, WATCH_CHECK_S)
                if waited is Waited.UNSUPPORTED:
                    await trio.sleep(WATCH_INTERVAL_S)
        finally:
            self.watched.discard(key)

    async def found_at_restart(self, key: MemberKey, observation: supervision.Observation) -> None:
        """Journal a live runner found again after a restart (pid and start time, never pid
        alone); an exit found instead is journaled with its transition (see :meth:`apply`)."""
        if not isinstance(observation, supervision.Running):
            return
        await self.journal.member_event(
            key, now_ms(), MEMBER_REATTACHED,
            f"runner pid {observation.pid} (started {_utc_s(observation.start_time)}) is alive",
            runner_pid=observation.pid, runner_start_time=observation.start_time,
        )  # fmt: skip
        log.info("member re-attached member=%s runner_pid=%d runner_start_time=%.3f", key,
                 observation.pid, observation.start_time)  # fmt: skip

    def stop(self, record: MemberRecord, grace_period_s: int) -> None:
        """Have supervision cancel the member's runner (in the nursery) and watch it end."""
        log.info("member cancelling member=%s grace_s=%d", record.key, grace_period_s)
        self.nursery.start_soon(supervision.cancel, Path(record.member_dir), grace_period_s)
        self._watch(record.key)


def _utc_s(at_s: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at_s))


def _collected(observation: supervision.Exited, how: str) -> ExtraEvent:
    """The ``exit-collected`` note for an exit the agent found on disk when it restarted."""
    pid = "an unknown pid" if observation.runner_pid is None else f"pid {observation.runner_pid}"
    return ExtraEvent(
        EXIT_COLLECTED,
        f"runner {pid} recorded {how} at {_utc_s(observation.finished_at)}; found when the "
        "agent restarted",
        {
            "runner_pid": observation.runner_pid,
            "exit_code": observation.exit_code,
            "signal": observation.signal,
            "exited_at_ms": int(observation.finished_at * 1000),
        },
    )
