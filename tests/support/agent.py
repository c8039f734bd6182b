"""Start a real ``tuneplane-node`` (enroll + run) as a subprocess for integration tests.

Rules: the agent is the real CLI in its own process; its log goes to ``<state_dir>/../<name>.log``;
whoever starts it owns it, and every agent this helper started is reaped (SIGKILL as a last resort
at exit) so a failed test leaves no stray daemon behind. Waits poll files the agent writes
atomically (status.json), never fixed sleeps. Every agent gets a real node.toml: as root, a pool
of fresh Unix accounts of its own (members never run as root) with work and output roots that
those accounts can reach; otherwise the agent's own user, as a non-root Node runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from tests.support import accounts, processes
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.processes import kill_now, stop_cleanly, track, untrack
from tuneplane.collector.template import COLLECTOR_NAME

CONNECT_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0
POOL_SIZE = 4


def node_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "tuneplane.agent.cli", *args]


def wait_until(what: str, check: Any, timeout: float = CONNECT_TIMEOUT_S) -> Any:
    """Poll ``check()`` until it returns something truthy (agents connect within 30 s)."""
    return processes.wait_until(what, check, timeout)


class AgentProcess:
    """An enrolled Node and its running daemon."""

    def __init__(
        self,
        state_dir: Path,
        out_root: Path,
        node_id: str,
        simulate_gpus: str | None,
        log_path: Path,
        config_path: Path,
        work_root: Path,
        pool: tuple[str, ...] = (),
        image_root: Path | None = None,
    ) -> None:
        self.state_dir = state_dir
        # The runtime image cache, beside the work root so members' sandboxes can reach it.
        self.image_root = image_root or work_root.parent / f"{work_root.name}-images"
        self.out_root = out_root
        self.config_path = config_path
        self.work_root = work_root
        # The accounts this agent's members run as (empty when it runs them as its own user).
        self.pool = pool
        self.node_id = node_id
        self.simulate_gpus = simulate_gpus
        self.log_path = log_path
        self.journal_path = state_dir / "journal.db"
        self.status_path = state_dir / "status.json"
        # More `tuneplane-node run` options (--scripted-nvml FILE, --inventory-interval S).
        self.run_args: tuple[str, ...] = ()
        # What the daemon runs under: ``ip netns exec NS`` puts it on another host (netns.py).
        self.prefix_argv: tuple[str, ...] = ()
        # What runs the CLI in place of ``python -m tuneplane.agent.cli`` (a test's wrapper that
        # calls ``tuneplane.agent.cli.main``, e.g. to read the daemon's ``sys.modules``).
        self.entry_argv: tuple[str, ...] = ()
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self._proc is not None, "the agent is not running"
        return self._proc.pid

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def collector_pids(self) -> list[int]:
        """The member collectors running under this agent: forked from its collector template
        (named ``tp-collector``) or started as their own interpreter."""
        found = []
        for proc in psutil.Process(self.pid).children(recursive=True):
            try:
                if proc.name() == COLLECTOR_NAME or "tuneplane.collector.cli" in proc.cmdline():
                    found.append(proc.pid)
            except psutil.Error:
                continue
        return found

    def start(self, env: Mapping[str, str] | None = None) -> None:
        args = [
            "--config", str(self.config_path), "run", "--state-dir", str(self.state_dir),
            "--out-root", str(self.out_root), "--work-root", str(self.work_root),
        ]  # fmt: skip
        if not self.prefix_argv:
            # A previous release's agent (prefix_argv) has no --image-root.
            args += ["--image-root", str(self.image_root)]
        if self.simulate_gpus:
            args += ["--simulate-gpus", self.simulate_gpus]
        args += self.run_args
        self.status_path.unlink(missing_ok=True)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                [*self.prefix_argv, *(self.entry_argv or node_cli()), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
        track(self._proc)

    def read_log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def control_token(self) -> str:
        """The Node's control credential on disk: what a thief who can read the state dir takes."""
        return (self.state_dir / "credentials" / "control.token").read_text().strip()

    def status(self) -> dict[str, Any]:
        """The daemon's status.json ({} before it wrote one)."""
        try:
            data = json.loads(self.status_path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _check_alive(self) -> None:
        if self._proc is not None and self._proc.poll() is not None:
            raise AssertionError(
                f"the agent exited with {self._proc.returncode}; its log:\n{self.read_log()}"
            )

    def wait_connected(self, timeout: float = CONNECT_TIMEOUT_S) -> dict[str, Any]:
        def connected() -> dict[str, Any] | None:
            self._check_alive()
            status = self.status()
            return status if status.get("connected") else None

        result: dict[str, Any] = wait_until("the agent to connect", connected, timeout)
        return result

    def wait_exit(self, timeout: float = CONNECT_TIMEOUT_S) -> int:
        assert self._proc is not None
        try:
            code = self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the agent did not exit within {timeout:g} s") from None
        untrack(self._proc)
        self._proc = None
        return code

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run another ``tuneplane-node`` command against this state directory."""
        return subprocess.run(
            node_cli("--config", str(self.config_path), *args, "--state-dir", str(self.state_dir)),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def stop(self) -> None:
        """SIGTERM and check the agent stopped cleanly (exit status 0)."""
        proc = self._proc
        if proc is None:
            return
        self._proc = None
        stop_cleanly(proc, "agent", self.read_log, STOP_TIMEOUT_S)

    def kill(self) -> None:
        """SIGKILL: the crash the journal must survive."""
        proc = self._proc
        if proc is None:
            return
        self._proc = None
        kill_now(proc)

    def restart(self, env: Mapping[str, str] | None = None) -> None:
        """Stop (or reap) the daemon and run it again on the same state directory."""
        if self.alive():
            self.stop()
        elif self._proc is not None:
            untrack(self._proc)
            self._proc.wait()
            self._proc = None
        self.start(env)


def enroll(
    state_dir: Path,
    coordinator: CoordinatorProcess,
    name: str,
    simulate_gpus: str | None,
    scripted_nvml: str | None = None,
    prefix_argv: Sequence[str] = (),
) -> subprocess.CompletedProcess[str]:
    """Run the real ``tuneplane-node enroll`` with a fresh join token.

    ``scripted_nvml``: the enrolment reads that scripted NVML, so a test that runs the agent on
    one never reads the machine's real GPUs (it means the same on a GPU host). ``prefix_argv``
    runs it under a prefix (a network namespace: tests/support/netns.py).
    """
    args = [
        "enroll", "--state-dir", str(state_dir), "--coordinator", coordinator.control,
        "--ca", str(coordinator.ca_path), "--token", coordinator.create_join_token(),
        "--name", name,
    ]  # fmt: skip
    if simulate_gpus:
        args += ["--simulate-gpus", simulate_gpus]
    if scripted_nvml:
        args += ["--scripted-nvml", scripted_nvml]
    return subprocess.run(
        [*prefix_argv, *node_cli(*args)], capture_output=True, text=True, timeout=60, check=False
    )


#: Test agents serve outputs on a free loopback port unless their node.toml says otherwise: the
#: default (0.0.0.0:7463) would make two agents on one host, or two test runs, collide.
TEST_OUTPUTS = '[outputs]\nlisten = "127.0.0.1:0"\n'


def write_node_toml(path: Path, pool: tuple[str, ...], extra: str = "") -> None:
    """node.toml for a test agent: its own account pool as root, nothing to switch to otherwise,
    and its outputs listener on a free loopback port unless ``extra`` has an [outputs] table."""
    text = "" if "[outputs]" in extra else TEST_OUTPUTS
    if pool:
        names = ", ".join(f'"{n}"' for n in pool)
        text += f'[accounts]\nmode = "pool"\npool = [{names}]\n'
    path.write_text(extra + text)


def start_agent(
    tmp_path: Path,
    coordinator: CoordinatorProcess,
    name: str = "node-a",
    simulate_gpus: str | None = "h200:2",
    env: Mapping[str, str] | None = None,
    node_toml: str = "",
    run_args: tuple[str, ...] = (),
    prefix_argv: Sequence[str] = (),
) -> AgentProcess:
    """Enroll a Node under ``tmp_path/<name>`` and start ``tuneplane-node run`` for it.

    ``node_toml``: settings put before the test's [accounts] table (``isolation = "bwrap"``,
    [runtimes.*] tables); one that holds its own [accounts] table gets no pool. ``run_args``:
    more options for every ``run`` of this agent (restarts included). ``prefix_argv``: what
    ``enroll`` and every ``run`` run under (``host.prefix()`` from tests/support/netns.py).
    """
    state_dir = tmp_path / name
    scripted = (
        run_args[run_args.index("--scripted-nvml") + 1] if "--scripted-nvml" in run_args else None
    )
    done = enroll(state_dir, coordinator, name, simulate_gpus, scripted, prefix_argv)
    if done.returncode != 0:
        raise RuntimeError(f"tuneplane-node enroll failed ({done.returncode}): {done.stderr}")
    node = json.loads((state_dir / "node.json").read_text())
    pool: tuple[str, ...] = ()
    roots = tmp_path
    if accounts.is_root():
        if "[accounts]" not in node_toml:
            pool = tuple(accounts.make_pool(POOL_SIZE))
        roots = accounts.traversable_root(name)
    config_path = tmp_path / f"{name}-node.toml"
    write_node_toml(config_path, pool, node_toml)
    agent = AgentProcess(
        state_dir, roots / f"{name}-outputs", str(node["node_id"]), simulate_gpus,
        tmp_path / f"{name}.log", config_path, roots / f"{name}-work", pool,
        roots / f"{name}-images",
    )  # fmt: skip
    agent.run_args = run_args
    agent.prefix_argv = tuple(prefix_argv)
    agent.start(env)
    return agent


@contextmanager
def two_agents(
    root: Path, simulate_gpus: str | None = "h200:2"
) -> Iterator[tuple[CoordinatorProcess, AgentProcess, AgentProcess]]:
    """A coordinator under ``root`` and two connected agents, ``node-a`` and ``node-b``."""
    with start_coordinator(root) as coord:
        a = start_agent(root, coord, "node-a", simulate_gpus)
        b = start_agent(root, coord, "node-b", simulate_gpus)
        try:
            a.wait_connected()
            b.wait_connected()
            yield coord, a, b
        finally:
            for agent in (a, b):
                if agent.alive():  # a test may have killed or stopped it
                    agent.stop()


__all__ = ["AgentProcess", "enroll", "start_agent", "two_agents", "wait_until"]
