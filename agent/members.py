"""The member manager: Prepare, Commit, Abort, Cancel and exits, executed journal-first.

Rules:
- Every change is journaled (and committed) before it is acted on or answered: the journal
  transition first, then the message to the coordinator, then the process.
- Every command is idempotent: a repeat for a member in a later state gets the answer the journal
  already holds and never starts anything twice (the runner's launch claim is the last guard).
- A lost connection changes nothing here; only the coordinator's decisions and the runner's
  durable files move a member. Watchers are owned by the daemon's nursery.
- A member runs as the account its lease names (agent/accounts.py), in a work directory outside
  the state directory that only that account can enter, with an environment built from an
  allow-list (agent/launch_plan.py): nothing of the agent's own environment reaches it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from . import messages as m
from . import supervision
from .crashpoint import crashpoint
from .journal_records import MemberKey, MemberRecord
from .member_commands import Command, respond
from .member_state import IllegalTransition, MemberEvent, MemberState
from .members_base import now_ms
from .members_launch import MemberLaunches
from .members_prepare import MemberPrepares

log = logging.getLogger(__name__)

E = MemberEvent
S = MemberState


class MemberManager(MemberPrepares, MemberLaunches):
    """Executes member commands against the journal and supervision.

    One class in layers, each its own module: :class:`~tuneplane.agent.members_base.MemberBase`
    (state, paths), :class:`~tuneplane.agent.members_prepare.MemberPrepares` (Prepare) over
    :class:`~tuneplane.agent.members_pull.MemberPulls` (its runtime image's pull),
    :class:`~tuneplane.agent.members_exits.MemberExits` (exits, watching, stopping) under
    :class:`~tuneplane.agent.members_launch.MemberLaunches` (launch), and this class: the
    commands (Commit, Abort, Cancel) and replay after a restart.
    """

    # --- commands ----------------------------------------------------------------------------

    async def handle(self, command: m.MemberCommand) -> None:
        """Carry out one coordinator command (callers run them one at a time, in order)."""
        try:
            if isinstance(command, m.Prepare):
                await self.prepare(command)
            elif isinstance(command, m.Commit):
                await self.commit(command)
            elif isinstance(command, m.Abort):
                await self.abort(command)
            else:
                await self.cancel(command)
        except IllegalTransition as exc:
            # A watcher moved the member between our read and our write (a Cancel racing the
            # member's own exit). The journal refused and wrote nothing; the member's real
            # state stands and is reported from there.
            log.warning("command raced a state change command=%s member=%s reason=%s",
                        type(command).__name__, command.key, exc)  # fmt: skip

    async def commit(self, cmd: m.Commit) -> None:
        rendezvous = None
        if cmd.rendezvous is not None:
            rendezvous = (cmd.rendezvous.master_addr, cmd.rendezvous.master_port)
        record = await self._respond(Command.COMMIT, cmd.key, rendezvous=rendezvous)
        if record is not None and record.state in (S.COMMITTED, S.STARTING):
            await self.launch(record)

    async def abort(self, cmd: m.Abort) -> None:
        # An image pull in flight is cancelled, and has ended, before the abort is journaled.
        await self.stop_preparation(cmd.key)
        await self._respond(Command.ABORT, cmd.key, reason=cmd.reason or "the coordinator aborted")

    async def cancel(self, cmd: m.Cancel) -> None:
        # A member declared lost while this Node was away: the journal says so, for the on-call.
        if cmd.declared_lost:
            log.warning("member declared lost by the coordinator; stopping it member=%s "
                        "reason=%s", cmd.key, cmd.reason)  # fmt: skip
        await self._respond(
            Command.CANCEL,
            cmd.key,
            reason=cmd.reason or "cancelled",
            grace_period_s=cmd.grace_period_s,
            declared_lost=cmd.declared_lost,
        )

    async def _respond(
        self,
        command: Command,
        key: MemberKey,
        *,
        reason: str = "",
        rendezvous: tuple[str, int] | None = None,
        grace_period_s: int = 0,
        declared_lost: bool = False,
    ) -> MemberRecord | None:
        """Carry out what agent/member_commands.py says for this command: journal first, then
        free the rendezvous and start or stop. Returns the member's record afterwards."""
        record = await self.journal.member(key)
        answer = respond(command, None if record is None else record.state)
        if record is None or answer.event is None:
            state = "none" if record is None else record.state.value
            level = logging.ERROR if answer.error else logging.INFO
            log.log(level, "%s member=%s state=%s reason=%s", answer.note, key, state,
                    record.reason if record is not None else "")  # fmt: skip
            return record
        details: dict[str, object] = {}
        if answer.stop:
            grace_period_s = grace_period_s or record.grace_period_s
            details["grace_period_s"] = grace_period_s
        if declared_lost:
            details["declared_lost"] = True
        record, report = await self.journal.transition(
            key, answer.event, now_ms(),
            reason=reason,
            rendezvous=rendezvous,
            details=details or None,
        )  # fmt: skip
        if command is Command.ABORT:
            log.info("member aborted member=%s reason=%s", key, reason)
        if answer.release_rendezvous:
            await self.rendezvous.release(key)
        await self.report(report)
        if command is Command.COMMIT:
            crashpoint("after-commit-journaled")
        if answer.stop:
            self.stop(record, grace_period_s)
        return record

    # --- restart -----------------------------------------------------------------------------

    async def replay(self) -> None:
        """Bring every unfinished member up to date after a (re)start, before connecting.

        preparing -> refused (the prepare was cut short); committed/starting -> launch (the
        claim prevents a second start); running/cancelling -> re-attach by pid and start time,
        collecting exits that happened while the agent was down.
        """
        for record in await self.journal.members():
            key = record.key
            if record.state is S.PREPARING:
                image = await self._interrupted_pull(key)
                reason = "the agent stopped while preparing this member; prepare it again"
                if image is not None:
                    reason = (
                        f"the agent stopped while pulling the image {image} for this member; "
                        "it finishes the pull now, keeping what was verified, so retry the Job"
                    )
                _, report = await self.journal.transition(
                    key, E.PREPARE_FAILED, now_ms(), reason=reason
                )
                await self.report(report)
                await self.resume_pull(record)
            elif record.state is S.PREPARED and key.member_index == 0 and record.master_port:
                await self.rendezvous.hold_again(record)
            elif record.state in (S.COMMITTED, S.STARTING):
                log.info("replay resumes launch member=%s state=%s", key, record.state.value)
                await self.launch(record, after_restart=True)
            elif record.state in (S.RUNNING, S.CANCELLING):
                observation = supervision.observe(Path(record.member_dir))
                log.info("replay re-attaches member=%s observation=%s", key, observation)
                await self.found_at_restart(key, observation)
                if record.state is S.CANCELLING and isinstance(observation, supervision.Running):
                    self.stop(record, record.grace_period_s)
                else:
                    await self.apply(key, observation, after_restart=True)

    async def held(self) -> list[tuple[MemberKey, MemberState]]:
        return [(r.key, r.state) for r in await self.journal.members() if r.state in _HELD]

    async def undecided(self) -> list[MemberKey]:
        return [r.key for r in await self.journal.members() if r.state is S.PREPARED]


_HELD = frozenset({S.PREPARED, S.COMMITTED, S.STARTING, S.RUNNING, S.CANCELLING})
