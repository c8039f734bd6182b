"""The ``tuneplane-node run`` daemon: journal, replay, then the connect/reconnect loop.

Rules:
- One nursery owns every task: the command worker, the inventory and status loops, member
  watchers and the control session. Cancelling it (SIGTERM/SIGINT) stops the agent and never
  touches a member: runners live in their own sessions and the journal remembers them.
- A journal that fails its integrity check puts the agent in SAFE MODE: it connects, refuses every
  Prepare with the reason, touches no workload and says so in logs and the status file.
- The outputs listener (agent/outputs_server.py), bound before the run so a taken port stops
  the agent at start, is served in the same nursery; every Hello says where it is.
- GPU health and the inventory: agent/daemon_inventory.py; the control session, credential
  rotation and its crash points: agent/daemon_session.py.
"""

from __future__ import annotations

import logging
import os
import signal

import trio

from . import messages as m
from .adapter import open_aio_host
from .collectors import CollectorSupervisor
from .daemon_base import AGENT_VERSION
from .daemon_inventory import DaemonInventory
from .daemon_session import DaemonSession
from .daemon_status import service_status
from .heap_trim import trim_heap_loop
from .journal_owner import open_node_journal
from .journal_records import AGENT_FAILED, AGENT_STOPPED, JournalCorrupt
from .logship import LogShipper
from .members import MemberManager
from .members_base import now_ms
from .metric_hooks import HOOKS as METRIC_HOOKS
from .outputs_server import OutputsServer
from .runner_template import RUNNER_TEMPLATE_DIR, RunnerTemplate
from .sd_notify import ServiceNotifier

log = logging.getLogger(__name__)


class Daemon(DaemonInventory, DaemonSession):
    """The ``tuneplane-node run`` daemon. One class in layers, each its own module:
    :class:`~tuneplane.agent.daemon_base.DaemonBase` (state, status file),
    :class:`~tuneplane.agent.daemon_inventory.DaemonInventory` (inventory, XIDs, metrics),
    :class:`~tuneplane.agent.daemon_session.DaemonSession` (the control session), and this
    class: start-up and replay, the task tree, the command worker and the orderly stop.
    """

    # --- main --------------------------------------------------------------------------------

    async def run(self) -> None:
        """Run until cancelled. Members are left exactly as they are when it returns."""
        async with open_aio_host():
            try:
                self.journal = await open_node_journal(
                    self.state.journal_path, self.node.node_id, now_ms()
                )
            except JournalCorrupt as exc:
                self.status.safe_mode = True
                self.status.safe_mode_reason = (
                    f"{exc} The agent is in SAFE MODE: it refuses new members and touches no "
                    "running workload. Move the journal aside and run `tuneplane-node doctor`."
                )
                log.critical("safe mode reason=%s", self.status.safe_mode_reason)
            ended_by: BaseException | None = None
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self.status_loop)
                    nursery.start_soon(trim_heap_loop)
                    if self.outputs is not None:
                        server = OutputsServer(
                            self.outputs, self.journal.member if self.journal else None
                        )
                        await nursery.start(server.serve)
                    if self.journal is not None:
                        self.journal.on_commit = METRIC_HOOKS.journal_commit
                    if self.status.metrics_address:
                        nursery.start_soon(self.metrics_loop)
                    if self.journal is not None:
                        template = RunnerTemplate(self.state.root / RUNNER_TEMPLATE_DIR)
                        nursery.start_soon(template.run)
                        self.manager = MemberManager(
                            self.journal, self.state.members_dir, self.out_root,
                            lambda: self.inventory, self.node_address, self.publish, nursery,
                            work_root=self.work_root, policy=self.policy,
                            refresh=self.refresh_inventory, node_id=self.node.node_id,
                            runner_template=template, registries=self.registries,
                            image_root=self.image_root, image_max_bytes=self.image_max_bytes,
                        )  # fmt: skip
                        previous = await self.journal.record_start(
                            now_ms(), version=AGENT_VERSION, pid=os.getpid(),
                            state_dir=str(self.state.root),
                        )  # fmt: skip
                        log.log(
                            logging.WARNING if previous.how == "unclean" else logging.INFO,
                            "agent started pid=%d previous_stop=%s reason=%s", os.getpid(),
                            previous.how, previous.sentence(),
                        )  # fmt: skip
                        # XIDs and clears journaled before this start apply before anything is
                        # sent or launched; members an older agent prepared get their UUIDs.
                        await self.refresh_inventory()
                        await self.journal.fill_member_uuids(self.inventory, now_ms())
                        await self.manager.replay()
                        self.logship = LogShipper(self.journal, self.publish)
                        nursery.start_soon(self.logship.run)
                        self.collectors = CollectorSupervisor.under(
                            self.state.root, self.journal, self.ca_path,
                            system_interval_s=self.system_interval_s,
                            sample_gpus=self.source.gpu_source != "simulated",
                            scripted_nvml=self.source.scripted_nvml,
                            gpu_release_file=self.source.release_request,
                            max_files=self.telemetry_max_files,
                        )  # fmt: skip
                        nursery.start_soon(self.collectors.run)
                    nursery.start_soon(self.command_worker)
                    nursery.start_soon(self.inventory_loop)
                    self.ready.set()
                    await self.connect_loop()
            except BaseException as exc:
                ended_by = exc
                raise
            finally:
                if self.outputs is not None:
                    self.outputs.sock.close()
                with trio.CancelScope(shield=True):
                    self.status.connected = False
                    self.write_status()
                    if self.journal is not None:
                        # Only an orderly stop writes the marker the next start looks for; an
                        # error leaves its own event, so the next start reads the run as unclean.
                        if _orderly(ended_by):
                            await self.journal.node_event(
                                now_ms(), AGENT_STOPPED, "orderly stop", pid=os.getpid()
                            )
                        else:
                            await self.journal.node_event(
                                now_ms(), AGENT_FAILED, f"{type(ended_by).__name__}: {ended_by}",
                                pid=os.getpid(),
                            )  # fmt: skip
                        await self.journal.close()
                log.info("agent stopped node_id=%s", self.node.node_id)

    # --- member commands ---------------------------------------------------------------------

    async def command_worker(self) -> None:
        """Carry out the session's member commands one at a time, in order (safe mode refuses)."""
        async for command in self.commands_recv:
            if self.manager is None:
                await self._refuse_in_safe_mode(command)
                continue
            if isinstance(command, m.Prepare) and self.collectors is not None:
                # A collector follows a launch: the template's imports overlap Prepare and Commit.
                self.collectors.warm()
            if isinstance(command, m.Commit) and self.collectors is not None:
                # Before the Commit is journaled: a member that runs has its credential on disk.
                await self.collectors.accept_commit(command)
            await self.manager.handle(command)

    async def _refuse_in_safe_mode(self, command: m.MemberCommand) -> None:
        if isinstance(command, m.Prepare):
            reason = (
                "This Node's journal failed its integrity check (safe mode); it accepts no new "
                "members until an operator repairs it."
            )
            await self.publish(m.PrepareReply(command.key, False, reason, None))
        else:
            log.warning("safe mode ignores command=%s member=%s", type(command).__name__,
                        command.key)  # fmt: skip


def _orderly(ended_by: BaseException | None) -> bool:
    """Whether the daemon stopped because it was told to (cancelled by SIGTERM/SIGINT)."""
    if ended_by is None:
        return True
    if isinstance(ended_by, BaseExceptionGroup):
        return all(_orderly(e) for e in ended_by.exceptions)
    return isinstance(ended_by, trio.Cancelled | KeyboardInterrupt)


async def _tell_service_manager(daemon: Daemon, notifier: ServiceNotifier) -> None:
    """READY=1 once the journal is replayed, then the status line whenever it changes, looked
    at after each status.json write (no wakeup of its own; none at all without systemd)."""
    await daemon.ready.wait()
    line = service_status(daemon.status)
    notifier.ready(f"journal replayed; {line}")
    if not notifier.enabled:
        return

    def tell() -> None:
        nonlocal line
        now = service_status(daemon.status)
        if now != line:
            line = now
            notifier.status(line)

    daemon.status_watchers.append(tell)


async def run_daemon(daemon: Daemon, notifier: ServiceNotifier | None = None) -> None:
    """Run ``daemon`` until SIGTERM or SIGINT, then stop cleanly without touching members.
    ``notifier`` tells systemd (Type=notify) when it is ready, that it lives and that it stops."""
    notifier = notifier or ServiceNotifier()
    async with trio.open_nursery() as nursery:

        async def on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log.info("stopping on signal signal=%s; members keep running",
                             signal.Signals(signum).name)  # fmt: skip
                    notifier.stopping("stopping; members keep running")
                    nursery.cancel_scope.cancel()
                    return

        nursery.start_soon(on_signal)
        # From the start, not from READY: systemd arms the watchdog when it starts the process.
        nursery.start_soon(notifier.keep_watchdog)
        nursery.start_soon(_tell_service_manager, daemon, notifier)
        await daemon.run()
        nursery.cancel_scope.cancel()
