"""Prepare, journal-first: a member is journaled in ``preparing`` before anything is checked or
written for it, and ``prepared`` (owning its GPUs) only once its GPUs, runtime, account lease,
capsule, Derivation source and rendezvous have all been checked or materialised.

Rules:
- A repeated Prepare gets the answer the journal already holds (:meth:`prepare_answer`).
- Any refusal journals ``prepare-failed`` with its sentence before the PrepareReply says so.
- A member runs as the account its lease names (agent/accounts.py), in a work directory outside
  the state directory that only that account can enter; the lease is on disk before any of the
  member's files, so a crash holds the account until replay fails the member.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path

import trio

from tuneplane.proto.contract import jobspec

from . import accounts, runner_pyz
from . import messages as m
from .config import DEFAULT_RUNTIME_PATH, Runtime, WorkloadPolicy
from .crashpoint import crashpoint
from .image_cache import ReadyImage
from .image_errors import ImageError
from .image_ref import ImageRef, ImageRefError, parse_image_ref
from .init_from import INIT_FROM_DIR, materialise_init_from
from .journal_records import (
    IMAGE_PULL_CANCELLED,
    IMAGE_PULL_FAILED,
    IMAGE_PULL_STARTED,
    IMAGE_READY,
    GpuAlreadyOwned,
    MemberExists,
    MemberKey,
    MemberRecord,
    NewMember,
)
from .launch_plan import LAUNCHERS, UnknownLauncher, refused_loader_variable
from .member_state import (
    COMMITTED_OR_LATER,
    LIVE_STATES,
    IllegalTransition,
    MemberEvent,
    MemberState,
)
from .members_base import (
    Preparation,
    make_image_folders,
    now_ms,
    out_dir_for,
    work_dir_for,
)
from .members_pull import MemberPulls
from .prepare import CAPSULE_DIR, PrepareRefused, check_gpus, materialise, read_capsule
from .workload_checks import resolve_interpreter

log = logging.getLogger(__name__)

E = MemberEvent
S = MemberState


def runtime_of(spec: jobspec.JobSpec, policy: WorkloadPolicy) -> Runtime | ImageRef:
    """What a JobSpec's runtime id names on this Node: the node.toml runtime of ``host:<name>``
    (refused, with what this Node offers, when its interpreter is not an executable file here),
    or the image ``image:<registry>/<name>@sha256:<hex>`` pins (refused when it is not pinned by
    digest: the coordinator resolves a tag at Preview). Checked at Prepare, so no GPU is held for
    a Job this Node cannot start."""
    kind, _, name = spec.runtime_id.partition(":")
    if kind == "image":
        try:
            return parse_image_ref(spec.runtime_id)
        except ImageRefError as exc:
            raise PrepareRefused(str(exc)) from None
    if kind != "host" or not name:
        raise PrepareRefused(
            f"The runtime {spec.runtime_id!r} is neither a host runtime nor an image; this Node "
            f"runs {offered_runtimes(policy)}."
        )
    runtime = policy.runtime(name)
    where = resolve_interpreter(runtime.interpreter, runtime.path)
    if where is None or not os.access(where, os.X_OK):
        origin = (
            f"as [runtimes.{name}] of node.toml defines it"
            if runtime.configured
            else f"looked up on {runtime.path}, as node.toml has no [runtimes.{name}]"
        )
        raise PrepareRefused(
            f"This Node cannot run the runtime {spec.runtime_id!r}: its interpreter "
            f"{runtime.interpreter!r} ({origin}) is not an executable file here. This Node "
            f"runs {offered_runtimes(policy)}. Submit the Job on one of those, or ask this "
            f"Node's operator to install the interpreter or define [runtimes.{name}] in node.toml."
        )
    return runtime


def _pool_lease(record: MemberRecord) -> accounts.Lease | None:
    """The member's lease when it leased a pool account; None for any other lease, for none, and
    for a lease file that cannot be read (logged)."""
    try:
        lease = accounts.read_lease(Path(record.member_dir))
    except accounts.AccountError as exc:
        log.warning("account lease unreadable member=%s reason=%s", record.key, exc)
        return None
    return lease if lease is not None and lease.mode == "pool" else None


def offered_runtimes(policy: WorkloadPolicy) -> str:
    """What ``host:<name>`` runtimes this Node runs, in words for a refusal."""
    configured = sorted(policy.runtimes)
    tables = (
        ", ".join(f"host:{name}" for name in configured) + " (node.toml) and " if configured else ""
    )
    return (
        f"{tables}host:<program> for a program on {DEFAULT_RUNTIME_PATH}, and images pinned as "
        "image:<registry>/<name>@sha256:<digest>"
    )


class MemberPrepares(MemberPulls):
    """Prepare: journal the member in ``preparing``, check and materialise it, then answer.

    A member whose runtime image is not in the cache yet is answered later: its pull runs in a
    task the daemon's nursery owns (so the command worker, heartbeats and other members go on),
    journaled as it goes, and the rest of Prepare runs once the image is ready. An Abort cancels
    the pull (:meth:`stop_preparation`); a failed pull refuses the Prepare with its sentence.
    """

    @staticmethod
    def prepare_answer(record: MemberRecord) -> m.PrepareReply:
        """The reply a repeated Prepare gets: what the journal says happened the first time."""
        rendezvous = (
            m.Rendezvous(record.master_addr, record.master_port) if record.master_port else None
        )
        if record.state is S.PREPARED or record.state in COMMITTED_OR_LATER:
            # This agent holds the port of every member 0 it prepared (again after a restart).
            return m.PrepareReply(
                record.key, True, "", rendezvous, rendezvous_held=rendezvous is not None
            )
        reason = record.reason or f"the member is {record.state.value} on this Node"
        return m.PrepareReply(record.key, False, reason, None)

    async def prepare(self, cmd: m.Prepare) -> None:
        key = cmd.key
        spec: jobspec.JobSpec | None = None
        spec_error = ""
        try:
            spec = jobspec.loads(cmd.jobspec_json)
        except jobspec.JobSpecError as exc:
            spec_error = f"The JobSpec cannot be read: {exc}"
        member_dir = self.members_dir / str(key)
        # One inventory for the whole Prepare: the UUIDs journaled are the ones checked.
        inventory = self.inventory()
        uuids = cmd.gpu_uuids or tuple(
            gpu.uuid if (gpu := inventory.gpu(i)) is not None else "" for i in cmd.gpu_indexes
        )
        try:
            # A repeat is found by the insert itself: the first Prepare reads nothing before it.
            await self.journal.create_member(
                NewMember(
                    key=key,
                    member_count=cmd.member_count,
                    gpu_indexes=cmd.gpu_indexes,
                    gpu_uuids=uuids if len(uuids) == len(cmd.gpu_indexes) else (),
                    member_dir=str(member_dir),
                    out_dir=str(out_dir_for(self.out_root, key)),
                    grace_period_s=spec.grace_period_s if spec else 30,
                ),
                now_ms(),
            )
        except MemberExists:
            await self._prepare_repeated(key)
            return
        if self.runner_template is not None:
            # Its imports overlap this Prepare and the Commit: the launch then only forks it.
            self.nursery.start_soon(self.runner_template.warm)
        try:
            if spec is None:
                raise PrepareRefused(spec_error)
            runtime = runtime_of(spec, self.policy)
            if isinstance(runtime, Runtime):
                refused = refused_loader_variable(spec.env, runtime.name, runtime.allow_loader_env)
                if refused:
                    raise PrepareRefused(refused)
            pull = isinstance(runtime, ImageRef) and self.images.ready(runtime) is None
            if pull:
                # GPUs another member owns refuse the Prepare before minutes of pulling; without
                # a pull, the rest of Prepare checks them under the lock, once.
                owners, unnamed = await self.journal.gpu_owners_by_uuid()
                check_gpus(key, cmd.gpu_indexes, cmd.gpu_uuids, inventory, owners, unnamed)
        except PrepareRefused as exc:
            await self._refuse(key, str(exc))
            return
        if pull:
            assert isinstance(runtime, ImageRef)
            await self._start_pull(cmd, spec, runtime, uuids)
            return
        async with self.prepare_lock:
            await self._complete(cmd, spec, runtime, uuids)

    async def _prepare_repeated(self, key: MemberKey) -> None:
        """Answer a Prepare for a member the journal already holds, from what it holds."""
        existing = await self.journal.member(key)
        # The insert found the row, and the journal never removes a member.
        assert existing is not None
        if existing.state is S.PREPARING and key in self.preparations:
            # A resent Prepare (a reconnect) while the image is pulled: the answer comes when
            # the pull ends, as for the first one.
            log.info("prepare repeated while its image is prepared member=%s image=%s", key,
                     self.preparations[key].image)  # fmt: skip
            return
        log.info("prepare repeated run_id=%s member=%s state=%s", key.run_id, key,
                 existing.state.value)  # fmt: skip
        await self.publish(self.prepare_answer(existing))

    async def _refuse(self, key: MemberKey, reason: str) -> None:
        """Journal the member's Prepare as failed with ``reason`` (its GPUs were never owned),
        then answer and report it."""
        await self.rendezvous.release(key)
        log.warning("prepare refused run_id=%s member=%s reason=%s", key.run_id, key, reason)
        _, report = await self.journal.transition(key, E.PREPARE_FAILED, now_ms(), reason=reason)
        await self.publish(m.PrepareReply(key, False, reason, None))
        await self.report(report)

    async def _complete(
        self, cmd: m.Prepare, spec: jobspec.JobSpec, runtime: Runtime | ImageRef,
        uuids: tuple[str, ...],
    ) -> None:  # fmt: skip
        """The rest of Prepare, once the runtime is on this Node: the GPUs again (a pull may
        have taken minutes), the account lease, the member's files, the Derivation, the
        capsule, the rendezvous; then ``prepared`` is journaled and answered. The caller holds
        :attr:`prepare_lock`."""
        key = cmd.key
        member_dir = self.members_dir / str(key)
        rendezvous: m.Rendezvous | None = None
        try:
            owners, unnamed = await self.journal.gpu_owners_by_uuid()
            check_gpus(key, cmd.gpu_indexes, cmd.gpu_uuids, self.inventory(), owners, unnamed)
            # The lease is on disk before any file is written for the member, so a crash here
            # still holds the account until the member is failed on replay.
            held, ended, through = await self._pool_leases(key)
            # In a worker thread, with the files: choosing a pool account looks through the
            # process table, and the lease is fsynced before anything else is written.
            lease, work = await trio.to_thread.run_sync(
                self._lease_and_materialise, member_dir, held, cmd, spec.source_files, ended
            )  # fmt: skip
            self.reclaimed_through = max(self.reclaimed_through, through)
            if spec.init_from_source is not None:
                await trio.to_thread.run_sync(
                    self._init_from, key, spec, lease, work, cmd.init_from_fetch
                )
            launch = read_capsule(work)
            if launch.launcher not in LAUNCHERS:
                raise PrepareRefused(str(UnknownLauncher(launch.launcher)))
            checked = await self.rendezvous.check(cmd)
            if cmd.pick_rendezvous:
                rendezvous = await self.rendezvous.hold(cmd, member_dir)
            image = {"image": str(runtime)} if isinstance(runtime, ImageRef) else {}
            await self.journal.transition(
                key, E.PREPARE_SUCCEEDED, now_ms(),
                rendezvous=(rendezvous.master_addr, rendezvous.master_port) if rendezvous else None,
                details={"gpu_indexes": list(cmd.gpu_indexes), "gpu_uuids": list(uuids),
                         "runner_sha256": runner_pyz.recorded(work / CAPSULE_DIR), **checked,
                         **image},
            )  # fmt: skip
        except (PrepareRefused, GpuAlreadyOwned, accounts.AccountError, OSError) as exc:
            await self._refuse(key, str(exc))
            return
        log.info("member prepared run_id=%s member=%s gpus=%s", key.run_id, key,
                 list(cmd.gpu_indexes))  # fmt: skip
        crashpoint("after-prepare-journaled")
        await self.publish(
            m.PrepareReply(key, True, "", rendezvous, rendezvous_held=rendezvous is not None)
        )

    # --- runtime images ------------------------------------------------------------------------

    async def _start_pull(
        self, cmd: m.Prepare, spec: jobspec.JobSpec, ref: ImageRef, uuids: tuple[str, ...]
    ) -> None:
        """Journal that the member's image is being pulled, then pull it in a task of the
        daemon's nursery; the Prepare is answered when that task ends."""
        key = cmd.key
        try:
            await trio.to_thread.run_sync(make_image_folders, self.images.directory)
        except OSError as exc:
            await self._refuse(
                key,
                f"This Node cannot make its image cache {self.images.directory} ({exc.strerror});"
                " ask its operator to fix that folder or name another with --image-root.",
            )
            return
        await self.journal.member_event(key, now_ms(), IMAGE_PULL_STARTED, image=str(ref))
        log.info("image pull started member=%s image=%s", key, ref)
        preparation = Preparation(str(ref))
        self.preparations[key] = preparation
        self.nursery.start_soon(self._pull_then_prepare, cmd, spec, ref, uuids, preparation)

    async def _pull_then_prepare(
        self, cmd: m.Prepare, spec: jobspec.JobSpec, ref: ImageRef, uuids: tuple[str, ...],
        preparation: Preparation,
    ) -> None:  # fmt: skip
        key = cmd.key
        started = trio.current_time()
        try:
            image: ReadyImage | None = None
            failed: ImageError | None = None
            # Only the pull is in the Abort's scope: what is journaled after it never is cut.
            with preparation.scope:
                try:
                    image = await self._pull(key, ref)
                except ImageError as exc:
                    failed = exc
            if failed is not None:
                await self.journal.member_event(
                    key, now_ms(), IMAGE_PULL_FAILED, str(failed), image=str(ref)
                )
                await self._refuse(key, str(failed))
                return
            if image is None:
                log.info("image pull cancelled member=%s image=%s", key, ref)
                await self.journal.member_event(
                    key, now_ms(), IMAGE_PULL_CANCELLED,
                    "the coordinator aborted the member while its image was pulled; what was "
                    "verified stays in the cache", image=str(ref),
                )  # fmt: skip
                return
            took = round(trio.current_time() - started, 3)
            log.info("image ready member=%s image=%s bytes=%d layers=%d seconds=%.3f", key, ref,
                     image.bytes, image.layers, took)  # fmt: skip
            await self.journal.member_event(
                key, now_ms(), IMAGE_READY, image=str(ref), bytes=image.bytes,
                layers=image.layers, seconds=took,
            )  # fmt: skip
            async with self.prepare_lock:
                record = await self.journal.member(key)
                if record is None or record.state is not S.PREPARING:
                    return
                await self._complete(cmd, spec, ref, uuids)
        except Exception as exc:
            # Whatever else goes wrong must still answer the Prepare (a member left preparing
            # would keep its Job waiting for the deadline) and never end the daemon.
            log.exception("image preparation failed unexpectedly member=%s", key)
            with contextlib.suppress(IllegalTransition):
                await self._refuse(
                    key,
                    f"The Node failed unexpectedly while preparing the image {ref} "
                    f"({type(exc).__name__}: {exc}); the agent's log has the details.",
                )
        finally:
            self.preparations.pop(key, None)
            preparation.done.set()

    async def _pool_leases(
        self, key: MemberKey
    ) -> tuple[set[str], list[tuple[accounts.Account, list[Path]]], int]:
        """Pool accounts held by members that have not ended; the folders of members that ended
        since the last Prepare gave theirs back (every ended member at the first Prepare after
        the agent started), by account; and the journal event that covers.

        All of it comes from the journal and the members' lease files alone, so it is the same
        after an agent restart; a Prepare reads the live members and the newly ended ones, never
        the whole history. A lease file that cannot be read holds nothing back: its member
        cannot launch either.
        """
        held: set[str] = set()
        for record in await self.journal.members_of(LIVE_STATES):
            lease = None if record.key == key else _pool_lease(record)
            if lease is not None:
                held.add(lease.account.name)
        ended, through = await self.journal.members_ended_after(self.reclaimed_through)
        folders: dict[str, tuple[accounts.Account, list[Path]]] = {}
        for record in ended:
            lease = _pool_lease(record)
            if lease is not None:
                _, paths = folders.setdefault(lease.account.name, (lease.account, []))
                paths += [lease.work_dir, Path(record.out_dir)]
        return held, list(folders.values()), through

    def _lease_and_materialise(
        self,
        member_dir: Path,
        held: set[str],
        cmd: m.Prepare,
        sources: Mapping[str, str],
        ended: list[tuple[accounts.Account, list[Path]]],
    ) -> tuple[accounts.Lease, Path]:
        """Lease the member's account and record the lease durably, then write its files."""
        key = cmd.key
        lease = accounts.lease_for(self.policy, held, work_dir_for(self.work_root, key), cmd.owner)
        accounts.write_lease(member_dir, lease)
        log.info("account leased member=%s account=%s uid=%d mode=%s work_dir=%s", key,
                 lease.account.name, lease.account.uid, lease.mode, lease.work_dir)  # fmt: skip
        return lease, self._materialise(member_dir, lease, cmd, sources, ended)

    def _materialise(
        self,
        member_dir: Path,
        lease: accounts.Lease,
        cmd: m.Prepare,
        sources: Mapping[str, str],
        ended: list[tuple[accounts.Account, list[Path]]],
    ) -> Path:
        """Give the folders of pool members that ended back to root (their runners did that for
        members that ran), so no member leasing their account can read them; then write the
        member's files and give its work directory to its account (0700)."""
        for account, paths in ended:
            accounts.reclaim(paths, account)
        self.work_root.mkdir(mode=0o711, parents=True, exist_ok=True)
        lease.work_dir.mkdir(mode=0o700, exist_ok=True)
        os.chmod(lease.work_dir, 0o700)
        work = materialise(
            member_dir, cmd.jobspec_json, cmd.capsule_files, cmd.capsule_digests, sources,
            lease.work_dir,
        )  # fmt: skip
        if lease.switches_user:
            accounts.chown_tree(work, lease.account)
        return work

    def _init_from(
        self,
        key: MemberKey,
        spec: jobspec.JobSpec,
        lease: accounts.Lease,
        work: Path,
        fetch: m.InitFromFetch | None,
    ) -> None:
        """Copy (or fetch from the Node that holds it) and verify the Derivation's source into
        the work dir (agent/init_from.py), then give it to the member's account like the rest
        of the work dir."""
        source = spec.init_from_source
        assert source is not None
        dest = work / INIT_FROM_DIR
        copied = materialise_init_from(source, self.out_root, dest, self.node_id, fetch)
        if lease.switches_user:
            accounts.chown_tree(dest, lease.account)
        log.info("init-from materialised member=%s source_run=%s files=%d bytes=%d dir=%s",
                 key, source.run_id, source.files, copied, dest)  # fmt: skip
