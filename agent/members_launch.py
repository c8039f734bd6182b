"""Launch, after Commit: a committed member's files read back, its GPUs checked again on a fresh
probe, its runner's launch written and claimed, and the runner started.

Rules:
- A member is started at most once per attempt: the runner's launch claim refuses a second
  start, so launch is safe to call again after a crash (replay does).
- The workload's environment is built from an allow-list (agent/launch_plan.py): nothing of the
  agent's own environment reaches it. Anything that keeps the launch from happening ends the
  attempt with a sentence (``launch-failed``); a member is never left committed.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import trio

from tuneplane.proto.contract import jobspec
from tuneplane.runner.member_file import Account as RunAs

from . import accounts, image_host, runner_pyz, sandbox, supervision
from . import rendezvous as rdv
from .collectors import telemetry_dir, tensorboard_dir
from .config import Runtime
from .crashpoint import crashpoint
from .image_cache import ReadyImage
from .image_ref import ImageRef
from .image_sandbox import ImageSandboxError
from .init_from import ENV_NAME as INIT_FROM_ENV
from .init_from import INIT_FROM_DIR
from .inventory import Inventory
from .journal_records import MemberKey, MemberRecord
from .launch_plan import (
    LaunchPlanError,
    member_env,
    plan_processes,
    refused_loader_variable,
    resolve_entrypoint,
    workload_env,
)
from .member_state import MemberEvent, MemberState
from .members_base import now_ms
from .members_exits import MemberExits
from .members_prepare import runtime_of
from .prepare import (
    CAPSULE_DIR,
    JOBSPEC_FILE,
    PrepareRefused,
    check_launch,
    pick_port,
    read_capsule,
)

log = logging.getLogger(__name__)

E = MemberEvent
S = MemberState


class LaunchFailed(Exception):
    """The member cannot be launched; ``str()`` is journaled as the reason it was aborted."""


class MemberLaunches(MemberExits):
    """Launch a committed member's runner, at most once, and journal what followed."""

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
        image: ReadyImage | None = None
        if isinstance(runtime, ImageRef):
            image = self.images.ready(runtime)
            if image is None:
                raise LaunchFailed(
                    f"The image {runtime} is no longer in this Node's image cache "
                    f"({self.images.directory}) although the member was prepared with it; retry "
                    f"the Job with `tp job retry {record.key.run_id}`: its Prepare pulls the "
                    "image again."
                )
        else:
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
        ours = {
            **member_env(
                key.run_id,
                key.attempt,
                key.member_index,
                record.member_count,
                out_dir,
                telemetry,
                tensorboard,
                spec.parameter_env,
            ),
            # The Derivation's source, copied and verified at Prepare (agent/init_from.py).
            **(
                {INIT_FROM_ENV: str(lease.work_dir / INIT_FROM_DIR)}
                if spec.init_from_source is not None
                else {}
            ),
            # The interface that routes to the rendezvous, unless the Job's env names one.
            **rdv.ifname_env(addr, spec.env),
        }
        wrapper: tuple[str, ...] = ()
        if image is not None:
            # The member runs in the image's root under bubblewrap, whatever node.toml's
            # isolation says (agent/image_sandbox.py): the image's Env, then the Job's, then
            # TunePlane's; the recipe's command after the image's Entrypoint.
            try:
                box = image_host.member_sandbox(
                    root=image.root, work_dir=lease.work_dir, out_dir=out_dir,
                    telemetry_dir=telemetry, gpus=gpus, driver_version=inventory.driver_version,
                    config=image.config, command=capsule.entrypoint,
                )  # fmt: skip
                planned = image_host.image_launch(
                    box, image.config, capsule.entrypoint, spec.env, ours
                )
            except ImageSandboxError as exc:
                raise LaunchFailed(str(exc)) from None
            base_env, entrypoint, wrapper = planned.env, planned.entrypoint, planned.wrapper
        else:
            assert isinstance(runtime, Runtime)
            base_env = workload_env(spec.env, ours, runtime.path, str(lease.work_dir))
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
        if image is None and self.policy.isolation == "bwrap":
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

    def _write_launch(self, record: MemberRecord, inventory: Inventory) -> None:
        supervision.write_launch(self._plan(record, inventory))

    async def _launch_failed(self, key: MemberKey, reason: str) -> None:
        log.error("member launch failed member=%s reason=%s", key, reason)
        _, report = await self.journal.transition(key, E.LAUNCH_FAILED, now_ms(), reason=reason)
        await self.report(report)

    async def launch(self, record: MemberRecord, *, after_restart: bool = False) -> None:
        """Start a committed member's runner, at most once; safe to call again after a crash.

        ``after_restart``: replay calls it; a runner found already there is journaled as
        re-attached (alive) or as an exit collected (ended while the agent was down).
        """
        key = record.key
        member_dir = Path(record.member_dir)
        # Rank 0 binds the rendezvous port itself: the listener that held it goes first.
        await self.rendezvous.release(key)
        if record.state is S.COMMITTED:
            # Health and the index -> UUID mapping are checked again on a fresh probe: a card
            # lost or reordered since Prepare must not get the workload.
            inventory = await self.refresh() if self.refresh else self.inventory()
            try:
                # In a worker thread: an image member's plan reads the image and runs ldconfig.
                await trio.to_thread.run_sync(self._write_launch, record, inventory)
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
            await self.report(report)
        observation = supervision.observe(member_dir)
        found = after_restart and not isinstance(observation, supervision.NotStarted)
        if found:
            await self.found_at_restart(key, observation)
        if isinstance(observation, supervision.NotStarted):
            try:
                observation = await supervision.start_runner(
                    member_dir, template=self.runner_template
                )
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
