"""The members of attempts run as Slurm jobs: how each ended (its runner's exit record, read
from the shared folder when the Slurm job ended) and the members ``tp job show`` lists.

Rules: a member's exit is written once (a second write of the same member changes nothing),
before the Slurm job's end is recorded, so a coordinator that stops between the two reads the
exit records again and writes the same rows. Nothing here decides: the member's state is
:func:`tuneplane.coordinator.slurm_attempt.member_state`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..slurm_attempt import MemberExit, member_state
from ..values.jobs import Member
from .handle import Handle, first_row

if TYPE_CHECKING:  # core's JobReads reads members through this module
    from .core import Store


async def record_member_exits(
    store: Store, run_id: str, attempt: int, exits: Sequence[MemberExit], now: int
) -> None:
    """Record how each member of the attempt ended (once per member)."""

    async def work() -> None:
        async with store.transaction() as db:
            for e in exits:
                await db.execute(
                    "INSERT INTO slurm_member_exits (run_id, attempt, member_index, has_exit, "
                    "exit_code, signal, ended_at_ms) VALUES (?, ?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT (run_id, attempt, member_index) DO NOTHING",
                    (run_id, attempt, e.index, int(e.has_exit), e.exit_code, e.signal,
                     e.ended_at_ms),
                )  # fmt: skip
            detail = {
                "attempt": attempt,
                "exits": [[e.index, e.exit_code, e.signal] if e.has_exit else [e.index, None]
                          for e in exits],
            }  # fmt: skip
            await store.log_decision(db, now, "slurm member exits", detail, run_id=run_id)

    await store.shielded(work)


async def member_exits(db: Handle, run_id: str, attempt: int) -> tuple[MemberExit, ...]:
    """The exits recorded for an attempt run as a Slurm job (none before it ended)."""
    rows = await db.execute_fetchall(
        "SELECT member_index, has_exit, exit_code, signal, ended_at_ms "
        "FROM slurm_member_exits WHERE run_id = ? AND attempt = ? ORDER BY member_index",
        (run_id, attempt),
    )
    return tuple(MemberExit(int(r[0]), bool(r[1]), int(r[2]), int(r[3]), int(r[4])) for r in rows)


async def slurm_members(db: Handle, run_id: str, attempt: int) -> tuple[Member, ...]:
    """The members of an attempt run as a Slurm job, with their exits once recorded; () for an
    attempt that runs on Nodes."""
    row = await first_row(
        db,
        "SELECT members, slurm_state, has_exit FROM slurm_attempts "
        "WHERE run_id = ? AND attempt = ?",
        (run_id, attempt),
    )
    if row is None:
        return ()
    exits = {e.index: e for e in await member_exits(db, run_id, attempt)}
    members = []
    for index in range(int(row[0])):
        e = exits.get(index, MemberExit(index, False))
        members.append(
            Member(
                index=index, node_id="", state=member_state(str(row[1]), bool(row[2])),
                has_exit=e.has_exit, exit_code=e.exit_code, signal=e.signal, out_dir="",
                gpu_indexes=(), history=(), ended_at_ms=e.ended_at_ms,
            )
        )  # fmt: skip
    return tuple(members)
