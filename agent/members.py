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
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

import trio

from tuneplane.proto.contract import jobspec
from tuneplane.runner.member_file import Account as RunAs

from . import accounts, runner_pyz, sandbox, supervision
from . import messages as m
from . import rendezvous as rdv
from .atomic_file import write_atomic
from .collectors import telemetry_dir, tensorboard_dir
from .config import DEFAULT_RUNTIME_PATH, Runtime, WorkloadPolicy
from .crashpoint import crashpoint
from .init_from import ENV_NAME as INIT_FROM_ENV
from .init_from import INIT_FROM_DIR, materialise_init_from
from .inventory import Inventory
from .journal import Journal
from .journal_records import (
    EXIT_COLLECTED,
    MEMBER_REATTACHED,
    Exit,
    ExtraEvent,
    GpuAlreadyOwned,
    MemberKey,
    MemberRecord,
    NewMember,
    PendingReport,
)
from .launch_plan import (
    LAUNCHERS,
    LaunchPlanError,
    UnknownLauncher,
    plan_processes,
    refused_loader_variable,
    resolve_entrypoint,
    workload_env,
)
from .member_commands import Command, respond
from .member_state import (
    COMMITTED_OR_LATER,
    TERMINAL,
    IllegalTransition,
    MemberEvent,
    MemberState,
)
from .outputs_manifest import write_manifest
from .prepare import (
    CAPSULE_DIR,
    JOBSPEC_FILE,
    PrepareRefused,
    check_gpus,
    check_launch,
    materialise,
    pick_port,
    read_capsule,
)
from .workload_checks import resolve_interpreter

log = logging.getLogger(__name__)

E = MemberEvent
S = MemberState
WATCH_INTERVAL_S = 0.25
#: Member 0's copy of its attempt's rendezvous nonce (0600, in the root-only member directory),
#: so a restarted agent can hold the rendezvous listener of a prepared member again.
NONCE_FILE = "rendezvous.nonce"

Publish = Callable[[m.Outgoing], Awaitable[None]]


def now_ms() -> int:
    return int(time.time() * 1000)


def out_dir_for(out_root: Path, key: MemberKey) -> Path:
    """``$TUNEPLANE_OUT_DIR`` of a member: ``<out root>/<run id>/attempt-<n>/member-<i>``."""
    return out_root / key.run_id / f"attempt-{key.attempt}" / f"member-{key.member_index}"


def work_dir_for(work_root: Path, key: MemberKey) -> Path:
    """The member's work directory (its cwd and HOME): ``<work root>/<member key>``."""
    return work_root / str(key)


def runtime_of(spec: jobspec.JobSpec, policy: WorkloadPolicy) -> Runtime:
    """The node.toml runtime a JobSpec's ``host:<name>`` runtime id names, refused (with what
    this Node offers) when it is not a host runtime or its interpreter is not an executable file
    here: checked at Prepare, so no GPU is held for a Job this Node cannot start."""
    kind, _, name = spec.runtime_id.partition(":")
    if kind != "host" or not name:
        raise PrepareRefused(
            f"The runtime {spec.runtime_id!r} is not a host runtime; this Node runs "
            f"{offered_runtimes(policy)}."
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


def offered_runtimes(policy: WorkloadPolicy) -> str:
    """What ``host:<name>`` runtimes this Node runs, in words for a refusal."""
    configured = sorted(policy.runtimes)
    tables = (
        ", ".join(f"host:{name}" for name in configured) + " (node.toml) and " if configured else ""
    )
    return f"{tables}host:<program> for a program on {DEFAULT_RUNTIME_PATH}"


class LaunchFailed(Exception):
    """The member cannot be launched; ``str()`` is journaled as the reason it was aborted."""


class MemberManager:
    """Executes member commands against the journal and supervision.

    ``publish`` sends a message if a session is open (and drops it otherwise: reports are
    replayed from the journal after the next Welcome, and the coordinator repeats Prepare).
    """

    def __init__(
        self,
        journal: Journal,
        members_dir: Path,
        out_root: Path,
        inventory: Callable[[], Inventory],
        node_address: Callable[[], str],
        publish: Publish,
        nursery: trio.Nursery,
        *,
        work_root: Path,
        policy: WorkloadPolicy,
        refresh: Callable[[], Awaitable[Inventory]] | None = None,
        node_id: str = "",
    ) -> None:
        self.journal = journal
        # This Node's id: a Derivation whose source it holds itself is copied, not fetched.
        self.node_id = node_id
        self.members_dir = members_dir
        self.state_dir = members_dir.parent
        self.out_root = out_root
        self.work_root = work_root
        self.policy = policy
        self._inventory = inventory
        # A fresh probe for launch's re-check (the daemon's, with XIDs applied); without one,
        # the last inventory.
        self._refresh = refresh
        self._node_address = node_address
        self._publish = publish
        self._nursery = nursery
        self._watched: set[MemberKey] = set()
        # Member 0's rendezvous listeners, held from Prepare until just before launch or the end.
        self._listeners: dict[MemberKey, rdv.Listener] = {}

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

    async def _report(self, report: PendingReport | None) -> None:
        if report is not None:
            await self._publish(m.Report(report))

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
        existing = await self.journal.member(key)
        if existing is not None:
            log.info("prepare repeated run_id=%s member=%s state=%s", key.run_id, key,
                     existing.state.value)  # fmt: skip
            await self._publish(self.prepare_answer(existing))
            return
        spec: jobspec.JobSpec | None = None
        spec_error = ""
        try:
            spec = jobspec.loads(cmd.jobspec_json)
        except jobspec.JobSpecError as exc:
            spec_error = f"The JobSpec cannot be read: {exc}"
        member_dir = self.members_dir / str(key)
        # One inventory for the whole Prepare: the UUIDs journaled are the ones checked.
        inventory = self._inventory()
        uuids = cmd.gpu_uuids or tuple(
            gpu.uuid if (gpu := inventory.gpu(i)) is not None else "" for i in cmd.gpu_indexes
        )
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
        rendezvous: m.Rendezvous | None = None
        try:
            if spec is None:
                raise PrepareRefused(spec_error)
            owners, unnamed = await self.journal.gpu_owners_by_uuid()
            check_gpus(key, cmd.gpu_indexes, cmd.gpu_uuids, inventory, owners, unnamed)
            runtime = runtime_of(spec, self.policy)
            refused = refused_loader_variable(spec.env, runtime.name, runtime.allow_loader_env)
            if refused:
                raise PrepareRefused(refused)
            # The lease is on disk before any file is written for the member, so a crash here
            # still holds the account until the member is failed on replay.
            held, ended = await self._pool_leases(key)
            lease = accounts.lease_for(
                self.policy, held, work_dir_for(self.work_root, key), cmd.owner
            )
            accounts.write_lease(member_dir, lease)
            log.info("account leased member=%s account=%s uid=%d mode=%s work_dir=%s", key,
                     lease.account.name, lease.account.uid, lease.mode, lease.work_dir)  # fmt: skip
            work = await trio.to_thread.run_sync(
                self._materialise, member_dir, lease, cmd, spec.source_files,
                ended.get(lease.account.name, []),
            )  # fmt: skip
            if spec.init_from_source is not None:
                await trio.to_thread.run_sync(
                    self._init_from, key, spec, lease, work, cmd.init_from_fetch
                )
            launch = read_capsule(work)
            if launch.launcher not in LAUNCHERS:
                raise PrepareRefused(str(UnknownLauncher(launch.launcher)))
            checked = await self._check_rendezvous(cmd)
            if cmd.pick_rendezvous:
                rendezvous = await self._hold_rendezvous(cmd, member_dir)
            await self.journal.transition(
                key, E.PREPARE_SUCCEEDED, now_ms(),
                rendezvous=(rendezvous.master_addr, rendezvous.master_port) if rendezvous else None,
                details={"gpu_indexes": list(cmd.gpu_indexes), "gpu_uuids": list(uuids),
                         "runner_sha256": runner_pyz.recorded(work / CAPSULE_DIR), **checked},
            )  # fmt: skip
        except (PrepareRefused, GpuAlreadyOwned, accounts.AccountError, OSError) as exc:
            await self._release_rendezvous(key)
            reason = str(exc)
            log.warning("prepare refused run_id=%s member=%s reason=%s", key.run_id, key, reason)
            _, report = await self.journal.transition(
                key, E.PREPARE_FAILED, now_ms(), reason=reason
            )
            await self._publish(m.PrepareReply(key, False, reason, None))
            await self._report(report)
            return
        log.info("member prepared run_id=%s member=%s gpus=%s", key.run_id, key,
                 list(cmd.gpu_indexes))  # fmt: skip
        crashpoint("after-prepare-journaled")
        await self._publish(
            m.PrepareReply(key, True, "", rendezvous, rendezvous_held=rendezvous is not None)
        )

    async def _check_rendezvous(self, cmd: m.Prepare) -> dict[str, str]:
        """Every member but 0: prove this Node reaches member 0's rendezvous listener, or refuse
        the Prepare naming the address, the port and the interface tried from. Returns what the
        journal records of the check ({} when there was nothing to check)."""
        target = cmd.rendezvous
        if cmd.pick_rendezvous or target is None or not cmd.rendezvous_nonce:
            return {}
        try:
            route = await rdv.probe(target.master_addr, target.master_port, cmd.rendezvous_nonce)
        except rdv.Unreachable as exc:
            raise PrepareRefused(str(exc)) from None
        where = f"{target.master_addr}:{target.master_port}"
        log.info("rendezvous reached member=%s rendezvous=%s interface=%s local_address=%s",
                 cmd.key, where, route.interface, route.local_address)  # fmt: skip
        return {"rendezvous_checked": where, "rendezvous_interface": route.interface}

    async def _hold_rendezvous(self, cmd: m.Prepare, member_dir: Path) -> m.Rendezvous:
        """Member 0: hold a free port for the rendezvous (answering the other members' probes)
        and say where it is. The nonce is kept first, so a restarted agent can hold it again."""
        key = cmd.key
        await self._release_rendezvous(key)  # a Prepare cut short before its journal entry
        write_atomic(member_dir / NONCE_FILE, cmd.rendezvous_nonce.encode(), 0o600)
        address = rdv.advertised_address(self._node_address())
        try:
            listener = await rdv.open_listener(self._nursery, address, cmd.rendezvous_nonce)
        except rdv.ListenFailed as exc:
            raise PrepareRefused(str(exc)) from None
        self._listeners[key] = listener
        log.info("rendezvous held member=%s address=%s port=%d", key, address, listener.port)
        return m.Rendezvous(address, listener.port)

    async def _release_rendezvous(self, key: MemberKey) -> None:
        """Close member 0's rendezvous listener, if it holds one (idempotent)."""
        listener = self._listeners.pop(key, None)
        if listener is not None:
            await listener.aclose()
            log.info("rendezvous released member=%s port=%d", key, listener.port)

    async def _hold_again(self, record: MemberRecord) -> None:
        """After a restart: hold a prepared member 0's rendezvous port again, for the members
        whose Prepare still has to reach it. A port taken meanwhile is logged; their probes then
        fail and the attempt is aborted, never started to hang."""
        try:
            nonce = (Path(record.member_dir) / NONCE_FILE).read_text()
        except OSError as exc:
            log.warning("rendezvous nonce unreadable member=%s reason=%s", record.key, exc)
            return
        try:
            listener = await rdv.open_listener(
                self._nursery, record.master_addr, nonce, record.master_port
            )
        except rdv.ListenFailed as exc:
            log.warning("rendezvous not held again member=%s reason=%s", record.key, exc)
            return
        self._listeners[record.key] = listener
        log.info("rendezvous held again member=%s address=%s port=%d", record.key,
                 record.master_addr, record.master_port)  # fmt: skip

    async def _pool_leases(self, key: MemberKey) -> tuple[set[str], dict[str, list[Path]]]:
        """Pool accounts held by members that have not ended, and the ended members' paths.

        Both come from the journal and the members' lease files alone, so they are the same
        after an agent restart. A lease file that cannot be read holds nothing back: its member
        cannot launch either.
        """
        held: set[str] = set()
        ended: dict[str, list[Path]] = {}
        for record in await self.journal.members():
            if record.key == key:
                continue
            try:
                lease = accounts.read_lease(Path(record.member_dir))
            except accounts.AccountError as exc:
                log.warning("account lease unreadable member=%s reason=%s", record.key, exc)
                continue
            if lease is None or lease.mode != "pool":
                continue
            if record.state in TERMINAL:
                paths = ended.setdefault(lease.account.name, [])
                paths += [lease.work_dir, Path(record.out_dir)]
            else:
                held.add(lease.account.name)
        return held, ended

    def _materialise(
        self,
        member_dir: Path,
        lease: accounts.Lease,
        cmd: m.Prepare,
        sources: Mapping[str, str],
        previous: list[Path],
    ) -> Path:
        """Write the member's files, then give its work directory to its account (0700).

        A pool account's earlier members' directories first go back to root (their runners did
        that for members that ran), so this member cannot read them.
        """
        if lease.mode == "pool":
            accounts.reclaim(previous, lease.account)
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

    async def commit(self, cmd: m.Commit) -> None:
        rendezvous = None
        if cmd.rendezvous is not None:
            rendezvous = (cmd.rendezvous.master_addr, cmd.rendezvous.master_port)
        record = await self._respond(Command.COMMIT, cmd.key, rendezvous=rendezvous)
        if record is not None and record.state in (S.COMMITTED, S.STARTING):
            await self.launch(record)

    async def abort(self, cmd: m.Abort) -> None:
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
            await self._release_rendezvous(key)
        await self._report(report)
        if command is Command.COMMIT:
            crashpoint("after-commit-journaled")
        if answer.stop:
            self._stop(record, grace_period_s)
        return record

    def _stop(self, record: MemberRecord, grace_period_s: int) -> None:
        log.info("member cancelling member=%s grace_s=%d", record.key, grace_period_s)
        self._nursery.start_soon(supervision.cancel, Path(record.member_dir), grace_period_s)
        self._watch(record.key)

    # --- launch ------------------------------------------------------------------------------

    def _plan(self, record: MemberRecord, inventory: Inventory) -> supervision.MemberLaunch:
        member_dir = Path(record.member_dir)
        try:
            spec = jobspec.loads((member_dir / JOBSPEC_FILE).read_text())
        except (OSError, jobspec.JobSpecError) as exc:
            raise LaunchFailed(f"The member's JobSpec cannot be read: {exc}") from None
        try:
            lease = accounts.read_lease(member_dir)
        except accounts.AccountError as exc:
            raise LaunchFailed(str(exc)) from None
        if lease is None:
            raise LaunchFailed(
                f"The member has no account lease ({member_dir / accounts.LEASE_FILE}); it was "
                "prepared by an older agent, so start a new attempt."
            )
        try:
            capsule = read_capsule(lease.work_dir)
            runtime = runtime_of(spec, self.policy)
        except PrepareRefused as exc:
            raise LaunchFailed(str(exc)) from None
        refused = refused_loader_variable(spec.env, runtime.name, runtime.allow_loader_env)
        if refused:
            raise LaunchFailed(refused)
        problem = check_launch(record.gpu_indexes, record.gpu_uuids, inventory)
        if problem is not None:
            raise LaunchFailed(problem)
        gpus = []
        for index in record.gpu_indexes:
            gpu = inventory.gpu(index)
            assert gpu is not None  # check_launch found every index
            gpus.append(gpu)
        uuids = [gpu.uuid for gpu in gpus]
        addr, port = record.master_addr, record.master_port
        if not port:
            if record.member_count != 1:
                raise LaunchFailed("The Commit carried no rendezvous for a multi-member attempt.")
            addr = addr or "127.0.0.1"
            port = pick_port(addr)
        out_dir = Path(record.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        # The collector follows this directory; the SDK and TensorBoard writers log into it.
        telemetry = telemetry_dir(out_dir)
        telemetry.mkdir(exist_ok=True)
        tensorboard = tensorboard_dir(out_dir)
        tensorboard.mkdir(exist_ok=True)
        if lease.switches_user:
            accounts.chown_tree(out_dir, lease.account)
            # <run id>/attempt-<n> above it: passable, never listable, so a member cannot see
            # which other Jobs ran on this Node.
            for folder in (out_dir.parent, out_dir.parent.parent):
                if self.out_root in folder.parents:
                    os.chmod(folder, 0o711)
        key = record.key
        base_env = workload_env(
            spec.env,
            {
                # The recipe's parameters as the coordinator rendered them at Preview (the
                # digest covers them); the argv flags are in the capsule's entrypoint.
                **spec.parameter_env,
                "TUNEPLANE_RUN_ID": key.run_id,
                "TUNEPLANE_ATTEMPT": str(key.attempt),
                "TUNEPLANE_MEMBER_INDEX": str(key.member_index),
                "TUNEPLANE_MEMBER_COUNT": str(record.member_count),
                "TUNEPLANE_OUT_DIR": str(out_dir),
                "TUNEPLANE_TELEMETRY_DIR": str(telemetry),
                # Where libraries look for a TensorBoard log directory (docs/telemetry.md,
                # "Where to write"); the collector follows all of $TUNEPLANE_OUT_DIR anyway.
                "TUNEPLANE_TENSORBOARD_DIR": str(tensorboard),
                "TENSORBOARD_LOGDIR": str(tensorboard),
                "AIP_TENSORBOARD_LOG_DIR": str(tensorboard),
                # The Derivation's source, copied and verified at Prepare (agent/init_from.py).
                **(
                    {INIT_FROM_ENV: str(lease.work_dir / INIT_FROM_DIR)}
                    if spec.init_from_source is not None
                    else {}
                ),
                # The interface that routes to the rendezvous, unless the Job's env names one.
                **rdv.ifname_env(addr, spec.env),
            },
            runtime.path,
            str(lease.work_dir),
        )
        entrypoint = resolve_entrypoint(capsule.entrypoint, runtime.name, runtime.interpreter)
        try:
            processes = plan_processes(
                capsule.launcher, entrypoint, tuple(uuids), key.member_index,
                record.member_count, addr, port, base_env, lease.work_dir,
            )  # fmt: skip
        except LaunchPlanError as exc:
            raise LaunchFailed(str(exc)) from None
        account = None
        if lease.switches_user:
            # A pool account goes back to root with the member; a user keeps their own files.
            released = (str(lease.work_dir), str(out_dir)) if lease.mode == "pool" else ()
            account = RunAs(
                lease.account.name, lease.account.uid, lease.account.gid, lease.account.groups,
                reap=True, release_paths=released,
            )  # fmt: skip
        wrapper: tuple[str, ...] = ()
        if self.policy.isolation == "bwrap":
            present = {str(p) for p in Path("/dev").glob("nvidia*")}
            wrapper = sandbox.bwrap_argv(
                state_dir=self.state_dir, work_root=self.work_root, out_root=self.out_root,
                work_dir=lease.work_dir, out_dir=out_dir,
                devices=sandbox.gpu_devices(gpus, present),
            )  # fmt: skip
        return supervision.MemberLaunch(
            member_dir=member_dir,
            run_id=key.run_id,
            attempt=key.attempt,
            member_index=key.member_index,
            processes=processes,
            out_dir=out_dir,
            grace_period_s=record.grace_period_s,
            stdout_path=member_dir / "stdout.log",
            stderr_path=member_dir / "stderr.log",
            run_as=account,
            sandbox_argv=wrapper,
            sdk_path=lease.work_dir / CAPSULE_DIR / runner_pyz.RUNNER_PYZ,
        )

    async def _launch_failed(self, key: MemberKey, reason: str) -> None:
        log.error("member launch failed member=%s reason=%s", key, reason)
        _, report = await self.journal.transition(key, E.LAUNCH_FAILED, now_ms(), reason=reason)
        await self._report(report)

    async def launch(self, record: MemberRecord, *, after_restart: bool = False) -> None:
        """Start a committed member's runner, at most once; safe to call again after a crash.

        ``after_restart``: replay calls it; a runner found already there is journaled as
        re-attached (alive) or as an exit collected (ended while the agent was down).
        """
        key = record.key
        member_dir = Path(record.member_dir)
        # Rank 0 binds the rendezvous port itself: the listener that held it goes first.
        await self._release_rendezvous(key)
        if record.state is S.COMMITTED:
            # Health and the index -> UUID mapping are checked again on a fresh probe: a card
            # lost or reordered since Prepare must not get the workload.
            inventory = await self._refresh() if self._refresh else self._inventory()
            try:
                supervision.write_launch(self._plan(record, inventory))
            except supervision.LaunchAlreadyClaimed:
                log.info("launch already claimed member=%s", key)
            except (LaunchFailed, supervision.LaunchSpecError) as exc:
                await self._launch_failed(key, str(exc))
                return
            except OSError as exc:
                # A file or directory the launch needs could not be made (an out root that is
                # not a directory, a full disk): the Job's reason says so, and a retry can work.
                await self._launch_failed(
                    key,
                    f"The Node could not set up the member's files ({exc}). Ask the Node's "
                    f"operator to fix that, then retry the Job with `tp job retry {key.run_id}`.",
                )
                return
            except Exception as exc:
                # Whatever else goes wrong here must still end the attempt: a member left
                # committed would hold its GPUs and keep its Job starting forever.
                log.exception("member launch failed unexpectedly member=%s", key)
                await self._launch_failed(
                    key,
                    f"The Node failed unexpectedly while setting up the launch "
                    f"({type(exc).__name__}: {exc}); the agent's log has the details.",
                )
                return
            record, report = await self.journal.transition(key, E.SPAWN_REQUESTED, now_ms())
            await self._report(report)
        observation = supervision.observe(member_dir)
        found = after_restart and not isinstance(observation, supervision.NotStarted)
        if found:
            await self._found_at_restart(key, observation)
        if isinstance(observation, supervision.NotStarted):
            try:
                observation = await supervision.start_runner(member_dir)
            except supervision.LaunchAlreadyClaimed:
                observation = supervision.observe(member_dir)
            except (supervision.RunnerStartFailed, supervision.RunnerStartTimeout) as exc:
                observation = supervision.observe(member_dir)
                if isinstance(observation, supervision.NotStarted):
                    await self._launch_failed(key, str(exc))
                    return
        crashpoint("after-spawn")
        log.info("member spawned member=%s observation=%s", key, observation)
        await self.apply(key, observation, after_restart=found)

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
                await self._report(started)
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
        await self._report(report)
        if isinstance(observation, supervision.Running):
            self._watch(key)

    def _watch(self, key: MemberKey) -> None:
        if key not in self._watched:
            self._watched.add(key)
            self._nursery.start_soon(self._watch_member, key)

    async def _watch_member(self, key: MemberKey) -> None:
        """Poll the runner's files until the member ends (cheap: a few stats and a JSON read)."""
        try:
            while True:
                await trio.sleep(WATCH_INTERVAL_S)
                record = await self.journal.member(key)
                if record is None or record.state not in (S.RUNNING, S.CANCELLING, S.STARTING):
                    return
                observation = supervision.observe(Path(record.member_dir))
                if not isinstance(observation, supervision.Running):
                    await self.apply(key, observation)
                    return
        finally:
            self._watched.discard(key)

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
                _, report = await self.journal.transition(
                    key, E.PREPARE_FAILED, now_ms(),
                    reason="the agent stopped while preparing this member; prepare it again",
                )  # fmt: skip
                await self._report(report)
            elif record.state is S.PREPARED and key.member_index == 0 and record.master_port:
                await self._hold_again(record)
            elif record.state in (S.COMMITTED, S.STARTING):
                log.info("replay resumes launch member=%s state=%s", key, record.state.value)
                await self.launch(record, after_restart=True)
            elif record.state in (S.RUNNING, S.CANCELLING):
                observation = supervision.observe(Path(record.member_dir))
                log.info("replay re-attaches member=%s observation=%s", key, observation)
                await self._found_at_restart(key, observation)
                if record.state is S.CANCELLING and isinstance(observation, supervision.Running):
                    self._stop(record, record.grace_period_s)
                else:
                    await self.apply(key, observation, after_restart=True)

    async def _found_at_restart(self, key: MemberKey, observation: supervision.Observation) -> None:
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

    async def held(self) -> list[tuple[MemberKey, MemberState]]:
        return [(r.key, r.state) for r in await self.journal.members() if r.state in _HELD]

    async def undecided(self) -> list[MemberKey]:
        return [r.key for r in await self.journal.members() if r.state is S.PREPARED]


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


_HELD = frozenset({S.PREPARED, S.COMMITTED, S.STARTING, S.RUNNING, S.CANCELLING})
