"""The Slurm Executor: runs the Jobs of Fleets of kind slurm as Slurm jobs through slurmrestd.

Rules:
- One task, owned by the leading coordinator's task group, passes over its work soon after a
  change and then less often (:func:`~tuneplane.coordinator.slurm_attempt.next_poll_s`, from
  :data:`FASTEST_POLL_S` up to the tick), and when woken. It writes the next attempt of each
  queued Slurm Job, submits what is written and not submitted, reads every live attempt's
  Slurm job (one ``GET /jobs`` per Fleet and pass, however many Jobs it runs; a job not listed
  is asked alone), and carries out cancels. Decisions are the pure
  :mod:`tuneplane.coordinator.slurm_attempt`'s; the store records each before it is carried
  out where order matters.
- Submission is idempotent: an attempt's row (named ``tp-<run id>-a<n>``) is written before the
  submit, and a row without a job id is first looked for by name (``jobs_named``), so a
  coordinator killed between submit and record finds its job on the next pass (the first one
  after a start is that reconciliation) and never submits a second.
- slurmrestd not answering makes the attempts it holds ``unknown`` (never failed) until it
  answers; one Fleet's slurmrestd being down delays no other Fleet (each is asked under its own
  deadline).
- A cancel is SIGTERM (recorded, then sent), then Slurm's cancel after the Job's grace period.
- Members' logs are shipped into the log store at each read of the job (:mod:`.slurm_logs`),
  every run's in order when Slurm requeued it; each member's exit is read, once the job ended,
  from its folder in the job's last run (the restart count Slurm reports as it ends).
- Each member's collector credential is minted (recorded) when its attempt is submitted and
  written beside the member (0600) with the attempt; live attempts keep it alive, and the end
  of the Slurm job starts its drain window.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path

import anyio
import attrs

from tuneplane.agent.atomic_file import write_atomic
from tuneplane.agent.crashpoint import crashpoint
from tuneplane.proto.contract import jobspec
from tuneplane.proto.contract.slurm_attempt import (
    ATTEMPT_FILE,
    CREDENTIAL_FILE,
    AttemptFile,
    attempt_dir,
    member_dir,
)
from tuneplane.runner.records import RecordError, read_exit_record

from .. import capsule
from ..catalogue import Catalogue
from ..clock import now_ms
from ..executors.slurm import (
    SlurmError,
    SlurmJob,
    SlurmJobNotFound,
    SlurmRefused,
    SlurmRest,
    SlurmSettingsError,
    jobs_named,
    open_slurm_rest,
    read_token,
)
from ..gateways.collector_credentials import CollectorCredentials
from ..slurm_attempt import (
    ADOPT,
    CANCEL,
    NEVER,
    SIGNAL,
    SIGTERM,
    MemberExit,
    SlurmAttemptFacts,
    cancel_step,
    job_request,
    member_exit,
    next_poll_s,
    submission,
)
from ..store.core import Store
from ..store.handle import StoreUnavailable
from ..store.lifecycle import cancel_job
from ..store.logs import LogStore
from ..store.slurm_attempts import (
    SlurmAttemptRow,
    queued_slurm_jobs,
    record_cancel_step,
    record_slurm_facts,
    record_slurm_job_id,
    reserve_slurm_attempt,
    slurm_attempt_inputs,
    slurm_attempts_to_drive,
)
from ..store.slurm_members import record_member_exits
from ..values.fleet import SlurmSettings
from ..values.jobs import MemberKey
from .slurm_logs import SlurmLogs

log = logging.getLogger(__name__)

#: How long one Fleet's slurmrestd may take over one pass before its attempts read ``unknown``.
FLEET_PASS_TIMEOUT_S = 20.0
REST_TIMEOUT_S = 5.0
#: The soonest pass after a change (a just-submitted or just-cancelled Job is asked this soon).
FASTEST_POLL_S = 0.05


class SlurmExecutor:
    def __init__(
        self,
        store: Store,
        catalogue: Catalogue,
        logs: LogStore,
        collectors: CollectorCredentials,
        ca_path: Path,
        tick_s: float = 1.0,
    ) -> None:
        self._store = store
        self._collectors = collectors
        self._ca_path = ca_path
        self._logs = SlurmLogs(logs)
        self._catalogue = catalogue
        self._tick_s = tick_s
        self._wake = anyio.Event()
        self.passes = 0
        # Writes this executor made (records, submits, cancel steps): a pass that made one is
        # followed by another soon.
        self.changes = 0
        self._kept_alive_ms = 0

    def wake(self) -> None:
        """Ask for a pass soon (a Job admitted, cancelled or retried)."""
        self._wake.set()

    async def run(self) -> None:
        """Drive Slurm attempts until cancelled."""
        interval = self._tick_s
        while True:
            with anyio.move_on_after(interval):
                await self._wake.wait()
            woken = self._wake.is_set()
            self._wake = anyio.Event()
            before = self.changes
            live = True
            try:
                live = await self.step()
            except StoreUnavailable as exc:
                log.warning("slurm pass failed; the next pass tries again reason=%s", exc)
            changed = woken or self.changes != before
            interval = next_poll_s(interval, changed, live, FASTEST_POLL_S, self._tick_s)

    async def step(self) -> bool:
        """One pass: reserve queued Slurm Jobs, then drive every live attempt, Fleet by Fleet.
        Whether any attempt is live."""
        self.passes += 1
        for run_id in await queued_slurm_jobs(self._store):
            await self._reserve(run_id)
        by_fleet: dict[str, list[SlurmAttemptRow]] = defaultdict(list)
        for row in await slurm_attempts_to_drive(self._store):
            by_fleet[row.fleet].append(row)
        # Live attempts keep their members' collector credentials alive, as heartbeats do: once
        # a tick, not at every fast pass.
        now = now_ms()
        if by_fleet and now - self._kept_alive_ms >= self._tick_s * 1000:
            self._kept_alive_ms = now
            await self._collectors.keep_slurm_alive(by_fleet, now)
        for fleet, rows in sorted(by_fleet.items()):
            settings = await self._store.slurm_settings(fleet)
            if settings is None:
                continue
            why = ""
            try:
                with anyio.fail_after(FLEET_PASS_TIMEOUT_S):
                    await self._drive_fleet(settings, rows)
            except (SlurmError, SlurmSettingsError) as exc:
                why = str(exc)
            except TimeoutError:
                why = f"slurmrestd at {settings.slurmrestd} took over {FLEET_PASS_TIMEOUT_S:g} s"
            if why:
                log.warning("slurmrestd unanswered fleet=%s reason=%s", fleet, why)
                await self._unreachable(rows, why)
        return bool(by_fleet)

    async def _reserve(self, run_id: str) -> None:
        job = await self._store.queued_job(run_id)
        if job is None:
            return
        try:
            spec = jobspec.loads(job.resolved_json)
        except jobspec.JobSpecError as exc:
            # As the Node scheduler does: the Job ends with the sentence instead of waiting.
            why = f"its JobSpec does not pass this coordinator's checks ({exc}) Submit it again"
            await cancel_job(self._store, run_id, "the coordinator", True, why, now_ms())
            log.warning("queued slurm job refused run_id=%s reason=%s", run_id, exc)
            return
        recipe = self._catalogue.get(spec.method_id)
        launcher = recipe.launcher if recipe is not None else "member"

        def seal(attempt: int, members: int) -> dict[str, str]:
            return capsule.seal(spec, launcher, job.run_id, attempt, members, job.digest)

        number = await reserve_slurm_attempt(self._store, job, seal, now_ms())
        if number is not None:
            self.changes += 1
            log.info("slurm attempt reserved run_id=%s attempt=%d", run_id, number)

    async def _drive_fleet(self, settings: SlurmSettings, rows: list[SlurmAttemptRow]) -> None:
        rest = await open_slurm_rest(
            settings.slurmrestd, read_token(settings.token_file), REST_TIMEOUT_S
        )
        try:
            # One request for the whole Fleet: every job slurmctld holds, by id and by name.
            listed = await rest.jobs()
            for row in rows:
                await self._drive(rest, settings, row, listed)
        finally:
            with anyio.CancelScope(shield=True):
                await rest.aclose()

    async def _drive(
        self, rest: SlurmRest, settings: SlurmSettings, row: SlurmAttemptRow,
        listed: list[SlurmJob],
    ) -> None:  # fmt: skip
        job_id = row.facts.job_id
        if job_id is None:
            job_id = await self._submit(rest, settings, row, listed)
            if job_id is None:
                return
        try:
            # Asked alone when not listed (submitted in this pass, or purged: then Slurm's
            # "invalid job id" is the answer that counts).
            job = next((j for j in listed if j.job_id == job_id), None) or await rest.job(job_id)
        except SlurmJobNotFound as exc:
            await self._record(row, attrs.evolve(row.facts, reachable=False,
                                                 unreachable_why=str(exc)))  # fmt: skip
            return
        # The logs first: once the end is recorded the Job is no longer driven.
        await self._logs.ship(settings, row, ended=job.exit is not None, restarts=job.restarts)
        if job.exit is not None:
            # The collectors' drain window starts (again: idempotent) and each member's exit is
            # recorded before the end is: once that is recorded the attempt is no longer driven.
            for key in _members(row):
                await self._collectors.member_ended(key, now_ms())
            folder = attempt_dir(settings.shared_dir, row.run_id, row.attempt)
            # From the folders of the run that ended: after a requeue, never the first run's.
            exits = await anyio.to_thread.run_sync(read_exits, folder, row.members, job.restarts)
            await record_member_exits(self._store, row.run_id, row.attempt, exits, now_ms())
        await self._record(row, _facts(job_id, job))
        if row.cancel_grace_s is not None and job.exit is None:
            await self._cancel(rest, row, job_id, row.cancel_grace_s)

    async def _submit(
        self, rest: SlurmRest, settings: SlurmSettings, row: SlurmAttemptRow,
        listed: list[SlurmJob],
    ) -> int | None:  # fmt: skip
        """The attempt's Slurm job: found by name among ``listed`` (this pass's listing, read
        before anything was submitted in it), or submitted now; None when a cancel came first
        (then it is never submitted)."""
        self.changes += 1
        found = jobs_named(listed, row.job_name)
        what, adopted = submission([j.job_id for j in found], row.cancel_grace_s is not None)
        if what == ADOPT and adopted is not None:
            await record_slurm_job_id(self._store, row.run_id, row.attempt, adopted, True, now_ms())
            log.info("slurm job found by name run_id=%s job_id=%d", row.run_id, adopted)
            return adopted
        if what == NEVER:
            never = SlurmAttemptFacts(slurm_state="CANCELLED", slurm_reason="never submitted")
            await record_slurm_facts(self._store, row.run_id, row.attempt, never, now_ms())
            return None
        try:
            folder = await self._write_attempt(settings, row)
        except OSError as exc:
            # Nothing was submitted; submitting later would meet the same folder. The attempt
            # fails with the sentence, and `tp job retry` tries again once it is fixed.
            why = (
                f"The coordinator cannot write the attempt's folder on the Fleet's shared folder "
                f"{settings.shared_dir} ({exc.strerror or exc}); make it writable by the "
                f"coordinator, then retry the Job"
            )
            failed = SlurmAttemptFacts(slurm_state="FAILED", slurm_reason=why)
            await record_slurm_facts(self._store, row.run_id, row.attempt, failed, now_ms())
            return None
        request = job_request(row.run_id, row.attempt, settings.partition, settings.python,
                              folder, row.members, row.gpus_per_member, row.gres_type,
                              row.constraint)  # fmt: skip
        try:
            job_id = await rest.submit(request)
        except SlurmRefused as exc:
            # slurmctld understood and said no (a shape the partition cannot hold): the attempt
            # fails with Slurm's words; submitting it again would be refused again.
            refused = SlurmAttemptFacts(slurm_state="FAILED", slurm_reason=str(exc))
            await record_slurm_facts(self._store, row.run_id, row.attempt, refused, now_ms())
            return None
        crashpoint("after-slurm-submit", job_id=job_id)
        await record_slurm_job_id(self._store, row.run_id, row.attempt, job_id, False, now_ms())
        log.info("slurm job submitted run_id=%s attempt=%d job_id=%d name=%s",
                 row.run_id, row.attempt, job_id, row.job_name)  # fmt: skip
        return job_id

    async def _write_attempt(self, settings: SlurmSettings, row: SlurmAttemptRow) -> Path:
        """Write ``attempt.json`` (atomically; again after a crash: same bytes) and return the
        attempt's folder."""
        resolved, capsule_files = await slurm_attempt_inputs(self._store, row.run_id, row.attempt)
        folder = attempt_dir(settings.shared_dir, row.run_id, row.attempt)
        gateways = self._collectors.telemetry_address
        tokens: list[str] = []
        ca_pem = ""
        if gateways:
            ca_pem = await anyio.to_thread.run_sync(self._ca_path.read_text)
            tokens = await self._collectors.issue_for_slurm(_members(row), row.fleet, now_ms())
        body = AttemptFile(
            row.run_id, row.attempt, row.members, row.gpus_per_member, resolved, capsule_files,
            capsule.digests(capsule_files),
            (gateways, *self._collectors.telemetry_fallbacks) if gateways else (), ca_pem,
            settings.spool_dir, settings.image_root, settings.registries_file,
        ).to_json()  # fmt: skip

        def write() -> None:
            # Each credential readable by the Slurm job's user alone, beside its member.
            for index, token in enumerate(tokens):
                path = member_dir(folder, index) / CREDENTIAL_FILE
                write_atomic(path, (token + "\n").encode(), 0o600, parents=True)
            write_atomic(folder / ATTEMPT_FILE, body.encode(), 0o644, parents=True)

        await anyio.to_thread.run_sync(write)
        return folder

    async def _cancel(self, rest: SlurmRest, row: SlurmAttemptRow, job_id: int, grace: int) -> None:
        step = cancel_step(row.signalled_at_ms, row.cancelled_at_ms, grace, now_ms())
        if step is None:
            return
        self.changes += 1
        await record_cancel_step(self._store, row.run_id, row.attempt, step, now_ms())
        if step == SIGNAL:
            await rest.signal(job_id, SIGTERM)
        elif step == CANCEL:
            await rest.cancel(job_id)
        log.info("slurm cancel step run_id=%s job_id=%d step=%s", row.run_id, job_id, step)

    async def _record(self, row: SlurmAttemptRow, facts: SlurmAttemptFacts) -> None:
        if facts != row.facts:
            self.changes += 1
            await record_slurm_facts(self._store, row.run_id, row.attempt, facts, now_ms())

    async def _unreachable(self, rows: list[SlurmAttemptRow], why: str) -> None:
        for row in rows:
            await self._record(row, attrs.evolve(row.facts, reachable=False, unreachable_why=why))


def read_exits(folder: Path, members: int, restarts: int) -> list[MemberExit]:
    """Each member's exit record on the shared folder, in the Slurm job's run after
    ``restarts`` requeues (one it cannot read counts as none)."""
    exits = []
    for index in range(members):
        try:
            record = read_exit_record(member_dir(folder, index, restarts))
        except RecordError as exc:
            log.warning("slurm member exit unreadable folder=%s reason=%s", folder, exc)
            record = None
        if record is None:
            exits.append(member_exit(index, None, None, None))
        else:
            exits.append(member_exit(index, record.exit_code, record.signal, record.finished_at))
    return exits


def _members(row: SlurmAttemptRow) -> list[MemberKey]:
    return [MemberKey(row.run_id, row.attempt, i) for i in range(row.members)]


def _facts(job_id: int, job: SlurmJob) -> SlurmAttemptFacts:
    return SlurmAttemptFacts(
        job_id=job_id, slurm_state=job.slurm_state, slurm_reason=job.reason, reachable=True,
        has_exit=job.exit is not None, exit_code=job.exit.code if job.exit else 0,
        signal=(job.exit.signal or 0) if job.exit else 0, restarts=job.restarts,
    )  # fmt: skip
