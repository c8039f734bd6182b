"""Member collectors: a ``tuneplane-collector run`` process for every member with telemetry to
deliver, and the private directory that holds its credential, spool and checkpoint.

Rules:
- ``<state dir>/collectors/<run id>.<attempt>.<member>/`` (0700) is the collector's: credential
  (0600), ``collector.json`` (the gateway, the other coordinators' gateways it falls back to,
  the CA), spool, checkpoint, log, markers. It is never under the member directory (the
  workload's cwd) or the out dir; a workload never sees a credential.
- The credential a Commit carries is written before the Commit is journaled, so a member that
  runs always has one on disk; a repeated Commit replaces it (the collector re-reads it) and
  its gateways (read by the next collector started, also by a restarted agent).
- A reconciliation loop keeps a collector running for every member that is starting, running
  or cancelling, and, once a member ended, writes ``member-exited`` and keeps its collector
  until it wrote ``drained``. A collector that stops early is restarted with backoff; it runs in
  its own process, so its crash never touches the member. The loop's nursery owns every one;
  cancelling it sends each collector SIGTERM (it resumes from its spool next time).
- Its first pass reads every member (an earlier run may have left an ended member's collector
  undrained); each later pass reads only the live members, those with a collector supervised
  and those the journal changed since (:mod:`~tuneplane.agent.journal_changes`), when one
  changes or every :data:`RECONCILE_INTERVAL_S`: ended members never cost an idle agent anything.
- A collector is forked from the collector template (agent/collector_template.py), warmed when
  a Prepare arrives, so a launch pays a fork instead of an interpreter's start and imports; where
  the template cannot start one, the collector is started as its own interpreter as before.
- A collector logs to ``collector.log`` in its directory, or, when the agent logs to journald
  (agent/daemon_log.py), to the agent's own stderr, so it logs to journald too, each entry
  naming its member (``journalctl -t tuneplane-collector TUNEPLANE_MEMBER=…``).
- Each collector follows its member's whole ``$TUNEPLANE_OUT_DIR`` (``--out-dir``): the
  telemetry directory, the TensorBoard directory (``$TENSORBOARD_LOGDIR``) and event and
  ``tuneplane.report`` files anywhere else under it, at most ``max_files`` at once.
- Each collector also samples its member's GPUs (by UUID, in the member's order) and process
  tree every ``system_interval_s`` (0: never), through the NVML the agent reads: the scripted
  double when the agent has ``--scripted-nvml``, none when its GPUs are simulated.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import attrs
import trio

from tuneplane.collector.defaults import (
    DEFAULT_MAX_FILES,
    SYSTEM_INTERVAL_S,
    TELEMETRY_SUBDIR,
    TENSORBOARD_SUBDIR,
)

from . import daemon_log
from . import messages as m
from .atomic_file import DirSync, write_atomic, write_json_atomic
from .collector_template import CollectorTemplate
from .journal import Journal
from .journal_records import MemberKey, MemberRecord
from .member_state import MemberState

log = logging.getLogger(__name__)

COLLECTORS_DIR = "collectors"
CREDENTIAL_FILE = "credential"
CONFIG_FILE = "collector.json"
EXITED_MARKER = "member-exited"
DRAINED_MARKER = "drained"
# A pass runs when a member changes; this is only the longest wait between two passes.
RECONCILE_INTERVAL_S = 30.0
RESTART_FIRST_S = 1.0
RESTART_MAX_S = 30.0
# A collector that ran this long before stopping was healthy: its restart backoff starts over.
HEALTHY_RUN_S = 60.0

# A collector starts once the member runs, not while its runner starts: the collector's own start
# (a fork, a TLS connection to the gateway) then no longer competes with the runner's for the
# CPU. It reads the member's files from their start, so nothing written before is missed.
_LIVE = frozenset({MemberState.RUNNING, MemberState.CANCELLING})
_ENDED = frozenset({MemberState.EXITED, MemberState.LOST, MemberState.ABORTED})


def telemetry_dir(out_dir: Path) -> Path:
    """``$TUNEPLANE_TELEMETRY_DIR`` of a member: ``$TUNEPLANE_OUT_DIR/telemetry``."""
    return out_dir / TELEMETRY_SUBDIR


def tensorboard_dir(out_dir: Path) -> Path:
    """``$TENSORBOARD_LOGDIR`` of a member: ``$TUNEPLANE_OUT_DIR/tensorboard``."""
    return out_dir / TENSORBOARD_SUBDIR


def _log_of(folder: Path, key: MemberKey) -> str:
    """Where a member's collector logs, as a log line names it."""
    if daemon_log.journald_in_use():
        return f"journalctl -t tuneplane-collector TUNEPLANE_MEMBER={key}"
    return str(folder / "collector.log")


def _gateway_args(config: dict[str, object]) -> list[str]:
    """``--gateway`` for the Commit's telemetry address, then for each of its fallbacks (a
    collector.json written before fallbacks existed has none)."""
    fallbacks = config.get("fallbacks", [])
    if not isinstance(fallbacks, list):
        raise TypeError(f"collector.json 'fallbacks' is {fallbacks!r}, not a list")
    return [
        arg for gateway in [config["gateway"], *fallbacks] for arg in ("--gateway", str(gateway))
    ]


@attrs.define(eq=False)
class CollectorSupervisor:
    """Owns the collectors of one Node. ``python`` runs ``tuneplane.collector.cli``."""

    root: Path
    journal: Journal
    ca_path: Path
    python: str = sys.executable
    # System series: seconds between samples (0: none); whether the GPUs can be read through
    # NVML (False for simulated GPUs); the scripted NVML file; the operator's GPU release file.
    system_interval_s: float = SYSTEM_INTERVAL_S
    sample_gpus: bool = True
    scripted_nvml: Path | None = None
    gpu_release_file: Path | None = None
    # The most telemetry files one member's collector follows at once.
    max_files: int = DEFAULT_MAX_FILES
    # Forks collectors instead of starting an interpreter each (agent/collector_template.py);
    # None: every collector is started as its own interpreter.
    template: CollectorTemplate | None = None
    _running: set[MemberKey] = attrs.field(factory=set, alias="running")

    @classmethod
    def under(
        cls,
        state_root: Path,
        journal: Journal,
        ca_path: Path,
        *,
        system_interval_s: float = SYSTEM_INTERVAL_S,
        sample_gpus: bool = True,
        scripted_nvml: Path | None = None,
        gpu_release_file: Path | None = None,
        max_files: int = DEFAULT_MAX_FILES,
    ) -> CollectorSupervisor:
        return cls(
            state_root / COLLECTORS_DIR, journal, ca_path,
            system_interval_s=system_interval_s, sample_gpus=sample_gpus,
            scripted_nvml=scripted_nvml, gpu_release_file=gpu_release_file,
            max_files=max_files, template=CollectorTemplate(),
        )  # fmt: skip

    def warm(self) -> None:
        """A Prepare came: a collector will likely follow, so have the template imported."""
        if self.template is not None:
            self.template.warm()

    def directory(self, key: MemberKey) -> Path:
        return self.root / str(key)

    async def accept_commit(self, command: m.Commit) -> None:
        """Store the credential a Commit carries, before the member manager journals it."""
        if not command.collector_credential:
            return
        record = await self.journal.member(command.key)
        if record is None:
            return
        await trio.to_thread.run_sync(
            self._write_credential,
            command.key,
            command.collector_credential,
            command.telemetry_address,
            command.telemetry_fallbacks,
        )
        log.info("collector credential stored member=%s gateway=%s fallbacks=%s", command.key,
                 command.telemetry_address,
                 ",".join(command.telemetry_fallbacks) or "-")  # fmt: skip
        # A repeated Commit may bring the first credential of a member already live.
        self.journal.changes.note(command.key)

    def _write_credential(
        self, key: MemberKey, credential: str, gateway: str, fallbacks: tuple[str, ...] = ()
    ) -> None:
        # Both files, and the member's folder if it is new, are durable before this returns
        # (the Commit is journaled after it), with each directory fsynced once.
        synced = DirSync()
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        folder = self.directory(key)
        if not folder.exists():
            folder.mkdir(mode=0o700)
            synced.add(self.root)
        folder.chmod(0o700)
        config = {"gateway": gateway, "fallbacks": list(fallbacks), "ca": str(self.ca_path)}
        write_json_atomic(folder / CONFIG_FILE, config, dir_sync=synced)
        write_atomic(folder / CREDENTIAL_FILE, (credential + "\n").encode(), 0o600, dir_sync=synced)
        synced.flush()

    async def run(self) -> None:
        """Reconcile until cancelled; every collector process is owned by this nursery."""
        follower = self.journal.changes.follow()
        async with trio.open_nursery() as nursery:
            if self.template is not None:
                nursery.start_soon(self.template.run)
            await self.reconcile_pass(nursery)
            while True:
                await follower.wait(RECONCILE_INTERVAL_S)
                await self.reconcile_pass(nursery, follower.take())

    async def reconcile_pass(
        self, nursery: trio.Nursery, changed: set[MemberKey] | None = None
    ) -> int:
        """One pass: every member when ``changed`` is None (the first), else the live ones, those
        supervised and those in ``changed``. Returns how many members it read."""
        if changed is None:
            records = await self.journal.members()
        else:
            records = await self.journal.members_of(_LIVE, changed | self._running)
        for record in records:
            await self._reconcile(record, nursery)
        return len(records)

    async def _reconcile(self, record: MemberRecord, nursery: trio.Nursery) -> None:
        key = record.key
        folder = self.directory(key)
        if record.state not in _LIVE | _ENDED:
            return
        if not (folder / CREDENTIAL_FILE).exists() or (folder / DRAINED_MARKER).exists():
            return
        if record.state in _ENDED and not (folder / EXITED_MARKER).exists():
            # The collector (running or started next) drains the files and ships the rest.
            await trio.to_thread.run_sync(write_atomic, folder / EXITED_MARKER, b"exited\n", 0o600)
            log.info("member ended; its collector drains member=%s", key)
        if key in self._running:
            return
        self._running.add(key)
        nursery.start_soon(self._supervise, record)

    def _args(self, record: MemberRecord) -> list[str]:
        """The arguments of ``tuneplane-collector`` for the member's collector."""
        folder = self.directory(record.key)
        config = json.loads((folder / CONFIG_FILE).read_text())
        key = record.key
        return [
            "run",
            "--telemetry-dir", str(telemetry_dir(Path(record.out_dir))),
            "--out-dir", record.out_dir,
            "--max-files", str(self.max_files),
            "--state-dir", str(folder),
            *_gateway_args(config),
            "--ca", str(config["ca"]),
            "--credential-file", str(folder / CREDENTIAL_FILE),
            "--run-id", key.run_id,
            "--attempt", str(key.attempt),
            "--member", str(key.member_index),
            *self._system_args(record),
        ]  # fmt: skip

    def _system_args(self, record: MemberRecord) -> list[str]:
        if self.system_interval_s <= 0:
            return []
        args = ["--system-interval", repr(self.system_interval_s),
                "--member-dir", record.member_dir]  # fmt: skip
        if not self.sample_gpus:
            return args
        if record.gpu_indexes and not record.gpu_uuids:
            log.warning("member GPUs have no UUIDs; its GPUs are not sampled member=%s",
                        record.key)  # fmt: skip
        for uuid in record.gpu_uuids:
            args += ["--gpu", uuid]
        if self.scripted_nvml is not None:
            args += ["--scripted-nvml", str(self.scripted_nvml)]
        if self.gpu_release_file is not None:
            args += ["--gpu-release-file", str(self.gpu_release_file)]
        return args

    async def _run_one(self, args: list[str], out_fd: int) -> int:
        """One collector process, forked from the template where it can be, until it exits;
        its exit code. ``out_fd`` is its stdout and stderr."""
        if self.template is not None:
            code = await self.template.run_collector(args, out_fd)
            if code is not None:
                return code
        # Its parent is this agent, named so that an orphan stops (collector/service.py); one
        # forked from the template watches the template, which ends with the agent.
        argv = [
            self.python,
            "-m",
            "tuneplane.collector.cli",
            *args,
            "--agent-pid",
            str(os.getpid()),
        ]
        done = await trio.run_process(argv, check=False, stdout=out_fd, stderr=subprocess.STDOUT)
        return done.returncode

    async def _supervise(self, record: MemberRecord) -> None:
        """Run the member's collector until it drained; restart it when it stops early."""
        key = record.key
        folder = self.directory(key)
        failures = 0
        try:
            while not (folder / DRAINED_MARKER).exists():
                started = trio.current_time()
                try:
                    args = self._args(record)
                    if daemon_log.journald_in_use():
                        log.info("collector started member=%s log=journald", key)
                        code = await self._run_one(args, sys.stderr.fileno())
                    else:
                        out = await trio.to_thread.run_sync(open, folder / "collector.log", "ab")
                        with out:
                            log.info("collector started member=%s", key)
                            code = await self._run_one(args, out.fileno())
                    status = f"exit status {code}"
                # ValueError, KeyError, TypeError: a collector.json _write_credential never wrote.
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    status = f"it could not start ({exc})"
                if (folder / DRAINED_MARKER).exists():
                    log.info("collector delivered everything member=%s", key)
                    return
                healthy = trio.current_time() - started > HEALTHY_RUN_S
                failures = 1 if healthy else failures + 1
                delay = min(RESTART_MAX_S, RESTART_FIRST_S * 2.0 ** (failures - 1))
                log.warning("collector stopped before delivering; restarting member=%s "
                            "status=%s in_s=%.0f log=%s", key, status, delay,
                            _log_of(folder, key))  # fmt: skip
                await trio.sleep(delay)
        finally:
            self._running.discard(key)
