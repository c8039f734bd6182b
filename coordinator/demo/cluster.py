"""A real TunePlane on loopback: one coordinator and N agents as separate processes.

Rules: every process this module starts is stopped by :meth:`LocalCluster.close` (SIGTERM, a
grace period, then SIGKILL), and the cluster waits on files the processes write atomically
(``endpoints.json``, the agent's ``status.json``) rather than on sleeps. Each agent reads a
node.toml of its own (``nodes/<name>.toml``): as root its members run as a slice of the cluster's
account pool that no other agent of the cluster uses (never as root), otherwise as the agent's
own user (``mode = "agent"``). Members' work and output roots lie in a folder those accounts can
pass through: ``members/`` inside the cluster's folder (which, as root, gets execute bits for
others, never read bits), or, when a folder above it is closed to other accounts (``/root`` is
0700), a fresh 0711 folder in /var/tmp that is kept for inspection. Nothing above the cluster's
folder is ever changed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import attrs

from . import accounts

# Where the member root goes when the cluster's own folder cannot be reached by pool accounts.
SPARE_MEMBER_PARENT = Path("/var/tmp")
MEMBER_ROOT_PREFIX = "tuneplane-members-"


class ClusterError(RuntimeError):
    """A process of the local cluster failed to start or stopped unexpectedly."""


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


@attrs.define(eq=False)
class ManagedProcess:
    """One child process with its log file; stopped politely, then firmly."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, grace: float = 15.0) -> int:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                return self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
        return self.popen.wait()

    def kill(self) -> None:
        """SIGKILL, as a crash or an OOM kill ends it: no cleanup runs."""
        if self.alive():
            self.popen.kill()
        self.popen.wait()


def _python_cli(module: str) -> list[str]:
    return [sys.executable, "-m", module]


COORDINATOR = _python_cli("tuneplane.coordinator.cli.admin")
NODE = _python_cli("tuneplane.agent.cli")
TP = _python_cli("tuneplane.coordinator.cli.tp")


def _run(argv: Sequence[str], what: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        list(argv), capture_output=True, text=True, env=env, timeout=120, check=False
    )
    if done.returncode != 0:
        raise ClusterError(f"{what} failed (exit {done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _wait_for_file(path: Path, proc: ManagedProcess, timeout: float) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise ClusterError(
                f"{proc.name} exited with {proc.popen.returncode} before writing {path.name}:\n"
                + _tail(proc.log_path)
            )
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            time.sleep(0.05)
            continue
        if isinstance(data, dict):
            return data
    raise ClusterError(f"{proc.name} did not write {path} within {timeout:.0f} s")


@attrs.define(eq=False)
class Agent:
    name: str
    state_dir: Path
    out_root: Path
    node_id: str
    process: ManagedProcess
    work_root: Path
    config_path: Path
    # The accounts its members run as; empty when they run as the agent's own user.
    pool: tuple[str, ...] = ()


def _names(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def running_as_root() -> bool:
    return os.geteuid() == 0


def _passable(folder: Path) -> None:
    """Let other accounts pass through ``folder`` (never list it): adds only execute bits."""
    mode = folder.stat().st_mode & 0o7777
    if not mode & 0o001:
        folder.chmod(mode | 0o011)


def node_toml(out_root: Path, work_root: Path, pool: Sequence[str]) -> str:
    """The node.toml of one cluster agent: its roots and who its members run as."""
    lines = [f"out_root = {json.dumps(str(out_root))}", f"work_root = {json.dumps(str(work_root))}"]
    # Several agents share this host: each serves its outputs on a port of its own.
    lines += ["", "[outputs]", 'listen = "127.0.0.1:0"']
    lines.append("")
    lines.append("[accounts]")
    if pool:
        lines.append('mode = "pool"')
        lines.append(f"pool = [{', '.join(json.dumps(name) for name in pool)}]")
    else:
        lines.append('mode = "agent"')
    return "\n".join(lines) + "\n"


@attrs.define(eq=False)
class LocalCluster:
    """Start with :meth:`start`; always :meth:`close` (it is also a context manager).

    ``member_pool`` (used only as root): the accounts the agents' members run as, handed out
    ``accounts_per_agent`` at a time in the order agents are added (default: the documented
    pool ``tuneplane-member-0`` .. ``7``, so two agents of four accounts each). The accounts must
    exist; :mod:`tuneplane.coordinator.demo.accounts` creates them.
    """

    root: Path
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0
    member_pool: tuple[str, ...] = attrs.field(default=(), converter=_names)
    accounts_per_agent: int = 4
    member_root: Path | None = None
    # The PostgreSQL database the coordinator keeps its stores in (``init --store``); "" for
    # the SQLite files of its state directory.
    store_url: str = ""
    # TOML appended to the coordinator.toml that ``init`` writes (the demo's ``[console]``).
    config: str = ""
    coordinator: ManagedProcess | None = None
    # The state directory (under ``root``) of the coordinator that ``tp`` and tokens go through.
    coordinator_name: str = "coordinator"
    # Every other coordinator process started here (standbys, a killed leader); close() stops
    # them too.
    others: list[ManagedProcess] = attrs.field(factory=list)
    endpoints: dict[str, object] = attrs.field(factory=dict)
    agents: list[Agent] = attrs.field(factory=list)
    # A sentence saying why the member root is outside the cluster's folder (None when inside).
    member_root_note: str | None = None

    @property
    def coordinator_dir(self) -> Path:
        return self.root / self.coordinator_name

    @property
    def context_path(self) -> Path:
        return self.coordinator_dir / "tp-context.json"

    def _spawn(self, name: str, argv: Sequence[str]) -> ManagedProcess:
        log_path = self.root / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            popen = subprocess.Popen(
                list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        return ManagedProcess(name, popen, log_path)

    def start_coordinator(self) -> None:
        state = self.coordinator_dir
        if not (state / "admin.token").exists():
            store = ["--store", self.store_url] if self.store_url else []
            _run(
                [*COORDINATOR, "init", "--state-dir", str(state), *store],
                "tuneplane-coordinator init",
            )
            if self.config:
                with (state / "coordinator.toml").open("a") as toml:
                    toml.write(self.config)
        (state / "endpoints.json").unlink(missing_ok=True)
        self.coordinator = self.serve(self.coordinator_name)
        self.endpoints = _wait_for_file(state / "endpoints.json", self.coordinator, 60)

    def serve(self, name: str) -> ManagedProcess:
        """Start ``serve`` on the state directory ``root/name`` (logged as ``name``)."""
        return self._spawn(
            name,
            [
                *COORDINATOR, "serve", "--state-dir", str(self.root / name),
                "--heartbeat-interval", str(self.heartbeat_interval),
                "--heartbeat-timeout", str(self.heartbeat_timeout),
                # Free ports: the demo must not collide with a coordinator on the fixed defaults.
                "--api-port", "0", "--control-port", "0", "--telemetry-port", "0",
            ],
        )  # fmt: skip

    def join_token(self, fleet: str = "default") -> str:
        out = _run(
            [
                *COORDINATOR, "token", "create", "--state-dir", str(self.coordinator_dir),
                "--fleet", fleet, "--ttl", "10m",
            ],
            "tuneplane-coordinator token create",
        )  # fmt: skip
        return out.strip().splitlines()[-1].strip()

    def members_root(self) -> Path:
        """Where every agent's work and output roots go; chosen once (see the module's rules)."""
        if self.member_root is not None:
            return self.member_root
        self.root.mkdir(parents=True, exist_ok=True)
        root = self.root / "members"
        if running_as_root():
            _passable(self.root)
            blocked = accounts.blocking_folder(self.root)
            if blocked is not None:
                root = Path(tempfile.mkdtemp(prefix=MEMBER_ROOT_PREFIX, dir=SPARE_MEMBER_PARENT))
                self.member_root_note = (
                    f"Members' work and output folders are in {root} (kept for inspection), "
                    f"because their accounts cannot pass through {blocked}."
                )
        root.mkdir(exist_ok=True)
        root.chmod(0o711)
        self.member_root = root
        return root

    def pool_for(self, index: int) -> tuple[str, ...]:
        """The accounts of the ``index``-th agent's members: empty unless running as root."""
        if not running_as_root():
            return ()
        pool = self.member_pool or accounts.DEFAULT_POOL
        start = index * self.accounts_per_agent
        mine = pool[start : start + self.accounts_per_agent]
        if len(mine) < self.accounts_per_agent:
            raise ClusterError(
                f"Agent {index + 1} needs {self.accounts_per_agent} member accounts, but the "
                f"cluster's pool of {len(pool)} has {len(mine)} left; give LocalCluster a larger "
                "member_pool."
            )
        absent = accounts.missing(mine)
        if absent:
            raise ClusterError(
                f"The member accounts {', '.join(absent)} do not exist; create them with "
                f"`{' '.join(accounts.USERADD)} NAME` (see docs/operator.md)."
            )
        return mine

    def add_agent(self, name: str, simulate_gpus: str | None) -> Agent:
        state = self.root / "nodes" / name
        pool = self.pool_for(len(self.agents))
        mine = self.members_root() / name
        out_root, work_root = mine / "outputs", mine / "work"
        for folder in (mine, out_root, work_root):
            folder.mkdir(exist_ok=True)
            folder.chmod(0o711)
        config = self.root / "nodes" / f"{name}.toml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(node_toml(out_root, work_root, pool))
        node_cli = [*NODE, "--config", str(config)]
        gpus = ["--simulate-gpus", simulate_gpus] if simulate_gpus else []
        _run(
            [
                *node_cli, "enroll", "--state-dir", str(state),
                "--coordinator", str(self.endpoints["control"]),
                "--ca", str(self.endpoints["ca"]), "--token", self.join_token(), *gpus,
            ],
            f"tuneplane-node enroll ({name})",
        )  # fmt: skip
        node = json.loads((state / "node.json").read_text())
        proc = self._spawn(name, [*node_cli, "run", "--state-dir", str(state), *gpus])
        agent = Agent(name, state, out_root, str(node["node_id"]), proc, work_root, config, pool)
        self.agents.append(agent)
        return agent

    def wait_connected(self, timeout: float = 60) -> None:
        """Until every agent's status file says it is connected to the coordinator."""
        deadline = time.monotonic() + timeout
        for agent in self.agents:
            while True:
                status = _wait_for_file(
                    agent.state_dir / "status.json", agent.process, deadline - time.monotonic()
                )
                if status.get("connected"):
                    break
                if time.monotonic() > deadline:
                    raise ClusterError(f"agent {agent.name} did not connect within {timeout} s")
                time.sleep(0.1)

    def tp(self, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        """Run the real `tp` against this cluster."""
        env = dict(os.environ, TUNEPLANE_CONTEXT=str(self.context_path))
        return subprocess.run(
            [*TP, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
            check=False,
        )  # fmt: skip

    def close(self) -> None:
        for agent in reversed(self.agents):
            agent.process.stop()
        if self.coordinator is not None:
            self.coordinator.stop()
        for other in self.others:
            other.stop()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
