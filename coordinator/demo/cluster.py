"""A real TunePlane on loopback: one coordinator and N agents as separate processes.

Rules: every process this module starts is stopped by :meth:`LocalCluster.close` (SIGTERM, a
grace period, then SIGKILL), and the cluster waits on files the processes write atomically
(``endpoints.json``, the agent's ``status.json``) rather than on sleeps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import attrs


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


@attrs.define(eq=False)
class LocalCluster:
    """Start with :meth:`start`; always :meth:`close` (it is also a context manager)."""

    root: Path
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0
    coordinator: ManagedProcess | None = None
    endpoints: dict[str, object] = attrs.field(factory=dict)
    agents: list[Agent] = attrs.field(factory=list)

    @property
    def coordinator_dir(self) -> Path:
        return self.root / "coordinator"

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
        if not (state / "coordinator.db").exists():
            _run([*COORDINATOR, "init", "--state-dir", str(state)], "tuneplane-coordinator init")
        (state / "endpoints.json").unlink(missing_ok=True)
        self.coordinator = self._spawn(
            "coordinator",
            [
                *COORDINATOR, "serve", "--state-dir", str(state),
                "--heartbeat-interval", str(self.heartbeat_interval),
                "--heartbeat-timeout", str(self.heartbeat_timeout),
            ],
        )  # fmt: skip
        self.endpoints = _wait_for_file(state / "endpoints.json", self.coordinator, 60)

    def join_token(self, fleet: str = "default") -> str:
        out = _run(
            [
                *COORDINATOR, "token", "create", "--state-dir", str(self.coordinator_dir),
                "--fleet", fleet, "--ttl", "10m",
            ],
            "tuneplane-coordinator token create",
        )  # fmt: skip
        return out.strip().splitlines()[-1].strip()

    def add_agent(self, name: str, simulate_gpus: str | None) -> Agent:
        state = self.root / "nodes" / name
        out_root = self.root / "outputs" / name
        gpus = ["--simulate-gpus", simulate_gpus] if simulate_gpus else []
        _run(
            [
                *NODE, "enroll", "--state-dir", str(state),
                "--coordinator", str(self.endpoints["control"]),
                "--ca", str(self.endpoints["ca"]), "--token", self.join_token(), *gpus,
            ],
            f"tuneplane-node enroll ({name})",
        )  # fmt: skip
        node = json.loads((state / "node.json").read_text())
        proc = self._spawn(
            name,
            [*NODE, "run", "--state-dir", str(state), "--out-root", str(out_root), *gpus],
        )
        agent = Agent(name, state, out_root, str(node["node_id"]), proc)
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

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
