"""Reading Jobs: a Job's view (attempts, members and their histories), the list of Jobs, the
member a log read names, a queued Job's launch facts, and the Nodes' free GPUs a placement is
offered.

Rules: reads only, on the store's reader; nothing here opens a write transaction.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from tuneplane.proto.contract.derivation_source import ManifestSummary

from .. import lifecycle as lc
from ..placement import NodeOffer
from ..slurm_attempt import member_state
from ..values.jobs import Attempt, Job, Member, MemberKey, QueuedJob, StateChange
from ..values.orders import Inventory
from .base import NotFound, StoreBase
from .handle import first_row
from .slurm_members import slurm_members


class JobReads(StoreBase):
    """Job views and the reads the scheduler places from."""

    async def get_job(self, run_id: str) -> Job:
        rows = list(
            await self.reader.execute_fetchall(
                "SELECT run_id FROM jobs WHERE run_id = ?",
                (run_id,),
            )
        )
        if not rows:
            raise NotFound(f"there is no Job with run id {run_id!r}. Check it with `tp ls`.")
        return (await self.job_views([run_id], full=True))[0]

    async def resolved_jobspec(self, run_id: str) -> str:
        """The Job's resolved JobSpec as its preview keeps it (JSON text; the Job's digest
        covers it); "" when there is no such Job."""
        row = await first_row(
            self.reader,
            "SELECT p.resolved_json FROM jobs j JOIN previews p ON p.id = j.preview_id "
            "WHERE j.run_id = ?",
            (run_id,),
        )
        return "" if row is None else str(row[0])

    async def member_for_logs(
        self, run_id: str, attempt: int, member_index: int
    ) -> tuple[MemberKey, str]:
        """The member a GetLogs names (attempt 0: the latest), with its state; or NotFound."""
        db = self.reader
        job = await first_row(db, "SELECT 1 FROM jobs WHERE run_id = ?", (run_id,))
        if job is None:
            raise NotFound(f"there is no Job with run id {run_id!r}. Check it with `tp job ls`.")
        if attempt == 0:
            (latest,) = await first_row(
                db,
                "SELECT COALESCE(MAX(number), 0) FROM attempts WHERE run_id = ?",
                (run_id,),
            )
            attempt = int(latest)
            if attempt == 0:
                raise NotFound(
                    f"the Job {run_id} has not been placed yet, so it has no logs. "
                    f"Watch it with `tp job show {run_id} --watch`."
                )
        row = await first_row(
            db,
            "SELECT state FROM members WHERE run_id = ? AND attempt = ? AND member_index = ?",
            (run_id, attempt, member_index),
        )
        if row is None:
            row = await self._slurm_member_state(run_id, attempt, member_index)
        if row is None:
            raise NotFound(
                f"the Job {run_id} has no member {member_index} in attempt {attempt}. "
                f"See its attempts and members with `tp job show {run_id}`."
            )
        return MemberKey(run_id, attempt, member_index), str(row[0])

    async def _slurm_member_state(
        self, run_id: str, attempt: int, member_index: int
    ) -> tuple[str] | None:
        """A member of an attempt run as a Slurm job, in a member's words: ``exited`` once the
        job ended, ``reserved`` until Slurm ran it, else ``running``; None when there is none."""
        row = await first_row(
            self.reader,
            "SELECT members, slurm_state, has_exit FROM slurm_attempts "
            "WHERE run_id = ? AND attempt = ?",
            (run_id, attempt),
        )
        if row is None or not 0 <= member_index < int(row[0]):
            return None
        return (member_state(str(row[1]), bool(row[2])),)

    async def list_jobs(
        self, project: str = "", state: str = "", owner: str = "", limit: int = 100
    ) -> list[Job]:
        clauses: list[str] = []
        args: list[Any] = []
        for column, value in (("project", project), ("state", state), ("owner", owner)):
            if value:
                clauses.append(f"{column} = ?")
                args.append(value)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        rows = await self.reader.execute_fetchall(
            f"SELECT run_id FROM jobs {where} ORDER BY created_at_ms DESC, run_id LIMIT ?",
            (*args, limit),
        )
        return await self.job_views([str(r[0]) for r in rows], full=False)

    async def job_views(self, run_ids: Sequence[str], full: bool) -> list[Job]:
        views = []
        for run_id in run_ids:
            r = await first_row(
                self.reader,
                "SELECT run_id, project, experiment, owner, state, fleet, profile, method_id, "
                "preview_id, digest, init_from, created_at_ms, state_reason, runtime_id FROM jobs "
                "WHERE run_id = ?",
                (run_id,),
            )
            history: tuple[StateChange, ...] = ()
            attempts: tuple[Attempt, ...] = ()
            if full:
                history = await self._history(
                    "SELECT state, at_ms, reason FROM job_states WHERE run_id = ? ORDER BY id",
                    (run_id,),
                )
                attempts = await self._attempt_views(run_id)
            views.append(
                Job(
                    run_id=str(r[0]),
                    project=str(r[1]),
                    experiment=str(r[2]),
                    owner=str(r[3]),
                    state=str(r[4]),
                    fleet=str(r[5]),
                    profile=str(r[6]),
                    method_id=str(r[7]),
                    preview_id=str(r[8]),
                    digest=str(r[9]),
                    init_from=str(r[10] or ""),
                    created_at_ms=int(r[11]),
                    history=history,
                    attempts=attempts,
                    state_reason=str(r[12]),
                    runtime_id=str(r[13]),
                )
            )
        return views

    async def _history(self, sql: str, args: Iterable[Any]) -> tuple[StateChange, ...]:
        rows = await self.reader.execute_fetchall(sql, tuple(args))
        return tuple(StateChange(str(s), int(t), str(why)) for s, t, why in rows)

    async def _attempt_views(self, run_id: str) -> tuple[Attempt, ...]:
        attempts = []
        rows = await self.reader.execute_fetchall(
            "SELECT number, decision, master_addr, master_port, created_at_ms FROM attempts "
            "WHERE run_id = ? ORDER BY number",
            (run_id,),
        )
        for number, decision, addr, port, created in rows:
            members = []
            mrows = await self.reader.execute_fetchall(
                "SELECT m.member_index, m.node_id, m.state, m.has_exit, m.exit_code, m.signal, "
                "m.out_dir, m.gpu_indexes_json, m.ended_at_ms, n.name, m.output_manifest_json "
                "FROM members m "
                "LEFT JOIN nodes n ON n.id = m.node_id WHERE m.run_id = ? AND m.attempt = ? "
                "ORDER BY m.member_index",
                (run_id, number),
            )
            for idx, node_id, state, has_exit, code, sig, out_dir, gpus, ended, name, mf in mrows:
                history = await self._history(
                    "SELECT state, at_ms, reason FROM member_states WHERE run_id = ? AND "
                    "attempt = ? AND member_index = ? ORDER BY id",
                    (run_id, number, idx),
                )
                members.append(
                    Member(
                        index=int(idx),
                        node_id=str(node_id),
                        state=str(state),
                        has_exit=bool(has_exit),
                        exit_code=int(code),
                        signal=int(sig),
                        out_dir=str(out_dir),
                        gpu_indexes=tuple(json.loads(gpus)),
                        history=history,
                        ended_at_ms=int(ended),
                        node_name=str(name or ""),
                        output_manifest=ManifestSummary.from_json(str(mf or "")),
                    )
                )
            if not members:
                members.extend(await slurm_members(self.reader, run_id, int(number)))
            state = {None: "preparing", lc.COMMIT: "committed", lc.ABORT: "aborted"}[decision]
            if await first_row(
                self.reader,
                "SELECT 1 FROM attempt_stops WHERE run_id = ? AND attempt = ? AND kind = 'cancel'",
                (run_id, number),
            ):
                state = "cancelled"
            attempts.append(
                Attempt(int(number), state, tuple(members), str(addr), int(port), int(created))
            )
        return tuple(attempts)

    async def queued_job(self, run_id: str) -> QueuedJob | None:
        """What a launch needs of one Job (its resolved JobSpec too); None unless queued.

        The scheduling pass reads the queue without the JobSpecs
        (:func:`~tuneplane.coordinator.store.queue_status.queued_requests`) and this only for
        the Jobs it launches.
        """
        r = await first_row(
            self.reader,
            "SELECT j.run_id, j.fleet, j.series, j.gpus, j.members_wanted, j.gpus_per_member, "
            "p.resolved_json, j.digest, j.owner FROM jobs j JOIN previews p ON p.id = j.preview_id "
            "WHERE j.run_id = ? AND j.state = ?",
            (run_id, lc.QUEUED),
        )
        if r is None:
            return None
        return QueuedJob(
            run_id=str(r[0]),
            fleet=str(r[1]),
            series=str(r[2]),
            gpus=int(r[3]),
            members=None if r[4] is None else int(r[4]),
            gpus_per_member=None if r[5] is None else int(r[5]),
            resolved_json=str(r[6]),
            digest=str(r[7]),
            owner=str(r[8]),
        )

    async def offers(self, fleet: str, series: str) -> list[NodeOffer]:
        """Connected, schedulable Nodes of ``fleet`` and their free healthy GPUs of ``series``."""
        nodes = await self.reader.execute_fetchall(
            "SELECT id, inventory_json FROM nodes WHERE fleet = ? AND connected = 1 "
            "AND scheduling = 'schedulable' ORDER BY id",
            (fleet,),
        )
        offers = []
        for node_id, inventory_json in nodes:
            inventory = Inventory.from_json(str(inventory_json))
            taken = {
                int(r[0])
                for r in await self.reader.execute_fetchall(
                    "SELECT gpu_index FROM reservations WHERE node_id = ?", (node_id,)
                )
            }
            free = tuple(
                g.index
                for g in inventory.gpus
                if g.healthy and g.series == series and g.index not in taken
            )
            offers.append(NodeOffer(str(node_id), free))
        return offers
