"""Start a real ``tuneplane-coordinator`` (init + serve) as a subprocess for integration tests.

Rules: the process is real (no in-process shortcuts), its log goes to ``<state_dir>/serve.log``,
and whoever starts it owns it: the context manager (or :meth:`CoordinatorProcess.stop`) always
reaps it, so a failed test never leaves a stray coordinator behind. Its stores are on the backend
the test runs on (:func:`tests.support.store_backend.current`: ``init --store`` on PostgreSQL).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.support.ports import quiet_ports
from tests.support.processes import kill_now, stop_cleanly, track, untrack
from tests.support.store_backend import current, read, where_in
from tuneplane.coordinator.store.core import Store

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0


def admin_argv(*args: str) -> list[str]:
    """``tuneplane-coordinator ARGS`` as this interpreter runs it (a release's ``prefix`` runs it
    under another: tests/support/release.py)."""
    return [sys.executable, "-m", "tuneplane.coordinator.cli.admin", *args]


class PortTaken(RuntimeError):
    """serve exited at start because one of its ports was taken meanwhile: start again on
    others."""


class CoordinatorProcess:
    """A running coordinator. Addresses are ``"127.0.0.1:<port>"``."""

    def __init__(
        self, state_dir: Path, serve_args: list[str], prefix_argv: Sequence[str] = ()
    ) -> None:
        self.state_dir = state_dir
        # What serve runs under: ``ip netns exec NS`` puts it on another host (tests/support/netns).
        self.prefix_argv = tuple(prefix_argv)
        self.ca_path = state_dir / "tls" / "ca.pem"
        self.context_path = state_dir / "tp-context.json"
        self.log_path = state_dir / "serve.log"
        self.admin_token = (state_dir / "admin.token").read_text(encoding="utf-8").strip()
        self.api = ""
        self.control = ""
        self.telemetry = ""
        self.serve_args = serve_args
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self._proc is not None, "the coordinator is not running"
        return self._proc.pid

    def start(
        self,
        ports: tuple[int, int, int] | None = None,
        env: Mapping[str, str] | None = None,
        standby: bool = False,
    ) -> None:
        """Start ``serve`` and wait for its endpoints.json (written once all listeners accept).

        ``env``: more environment for this run of ``serve`` only (``TUNEPLANE_CRASHPOINT``).
        ``standby``: wait only until it stands by (another coordinator on the same PostgreSQL
        store leads); :meth:`wait_leading` waits for it to take over."""
        # serve defaults to fixed ports (7443-7445); tests always pass theirs, free ones below
        # the ephemeral range (tests/support/ports.py) unless restarting, so parallel runs
        # never collide and a restart finds its ports again. serve_args come last and win.
        for attempt in range(3):
            try:
                self._start(ports or quiet_ports(3), env, standby)
            except PortTaken:
                if ports is not None or attempt == 2:
                    raise
                if self._proc is not None:  # exited: nothing left to stop
                    untrack(self._proc)
                    self._proc = None
            else:
                return

    def _start(self, ports: tuple[int, ...], env: Mapping[str, str] | None, standby: bool) -> None:
        api_port, control_port, telemetry_port = ports
        args = [
            "--api-port",
            str(api_port),
            "--control-port",
            str(control_port),
            "--telemetry-port",
            str(telemetry_port),
            *self.serve_args,
        ]
        offset = len(self.read_log())
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                [
                    *self.prefix_argv,
                    *admin_argv("serve", "--state-dir", str(self.state_dir), *args),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
        track(self._proc)
        if standby:
            self.wait_log("standing by", START_TIMEOUT_S, offset)
            return
        self.wait_leading(START_TIMEOUT_S, offset)

    def wait_log(self, text: str, timeout: float, after: int = 0) -> int:
        """Wait for ``text`` in serve.log past offset ``after``; the offset just past it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"tuneplane-coordinator serve exited with {self._proc.returncode}; its "
                    f"log:\n{self.read_log()}"
                )
            at = self.read_log().find(text, after)
            if at >= 0:
                return at + len(text)
            time.sleep(0.02)
        raise RuntimeError(f"no {text!r} in serve.log within {timeout:g} s:\n{self.read_log()}")

    def wait_leading(self, timeout: float = START_TIMEOUT_S, after: int = 0) -> None:
        """Wait until this serve leads: its endpoints.json names its pid (all listeners accept).
        A serve that exited instead is a :class:`PortTaken` when its log past ``after`` says a
        port was taken, else a RuntimeError."""
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        endpoints = self.state_dir / "endpoints.json"
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                log = self.read_log()
                kind = PortTaken if "Address already in use" in log[after:] else RuntimeError
                raise kind(
                    f"tuneplane-coordinator serve exited with {self._proc.returncode} before it "
                    f"was ready; its log:\n{log}"
                )
            try:
                data = json.loads(endpoints.read_text(encoding="utf-8"))
            except (FileNotFoundError, ValueError):
                data = {}
            if data.get("pid") == self._proc.pid:
                self.api, self.control, self.telemetry = (
                    data["api"],
                    data["control"],
                    data["telemetry"],
                )
                return
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"the coordinator was not ready in {timeout:g} s:\n{self.read_log()}")

    def read_log(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def ports(self) -> tuple[int, int, int]:
        api, control, telemetry = (
            int(a.rsplit(":", 1)[1]) for a in (self.api, self.control, self.telemetry)
        )
        return api, control, telemetry

    def create_join_token(
        self,
        fleet: str = "default",
        ttl: str = "1h",
        node: str | None = None,
        env: dict[str, str] | None = None,
    ) -> str:
        """A one-time join token, made by the real ``token create`` command; with ``node``, one
        that only re-enrolls that Node (``token create --node``); ``env`` runs the command in
        another environment (a moved clock: :func:`tests.support.processes.faketime_env`)."""
        for_node = ["--node", node] if node is not None else []
        out = subprocess.run(
            [*self.prefix_argv, *admin_argv(
                "token", "create", "--state-dir", str(self.state_dir), "--fleet", fleet,
                "--ttl", ttl, *for_node, "--json",
            )],
            check=True,
            capture_output=True,
            timeout=30,
            env=env,
        )  # fmt: skip
        made = json.loads(out.stdout)
        assert made.get("for_node") == node, made
        return str(made["token"])

    def create_user(self, name: str) -> str:
        """A new TunePlane user ``name``, made by the real ``user create``: its token."""
        made = self.admin("user", "create", name)
        assert made.returncode == 0, made.stderr
        return made.stdout.strip().splitlines()[-1]

    def user_token_file(self, name: str, folder: Path | None = None) -> Path:
        """:meth:`create_user`, with the token written to ``NAME.token`` in ``folder`` (the
        state directory when none is given), as ``tp --token-file`` reads it."""
        path = (folder or self.state_dir) / f"{name}.token"
        path.write_text(self.create_user(name) + "\n")
        return path

    def admin(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run another ``tuneplane-coordinator`` command against this state directory."""
        return subprocess.run(
            [*self.prefix_argv, *admin_argv(*args, "--state-dir", str(self.state_dir))],
            capture_output=True,
            text=True,
            timeout=30,
        )

    def decisions(self, kind: str, node_id: str = "") -> list[dict[str, Any]]:
        """The decision log's rows of ``kind`` (those about ``node_id`` only, when given)."""
        out = self.admin("decisions", "--json")
        assert out.returncode == 0, out.stderr
        rows = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
        return [r for r in rows if r["kind"] == kind and (not node_id or r["node_id"] == node_id)]

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def wait_exit(self, timeout: float = START_TIMEOUT_S) -> int:
        """Wait for ``serve`` to exit on its own (a crash point); its exit status."""
        assert self._proc is not None, "the coordinator is not running"
        try:
            code = self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the coordinator did not exit within {timeout:g} s") from None
        untrack(self._proc)
        self._proc = None
        return code

    def stop(self) -> None:
        """SIGTERM, wait, and check it stopped cleanly (exit status 0)."""
        proc = self._proc
        if proc is None:
            return
        self._proc = None
        stop_cleanly(proc, "coordinator", self.read_log, STOP_TIMEOUT_S)

    def kill(self) -> None:
        """SIGKILL: the crash a durable store must survive."""
        proc = self._proc
        if proc is None:
            return
        self._proc = None
        kill_now(proc)

    def restart(self, env: Mapping[str, str] | None = None) -> None:
        """Stop (if running) and start again on the same ports, so Nodes can reconnect."""
        ports = self.ports()
        if self._proc is not None:
            if self._proc.poll() is None:
                self.stop()
            else:
                untrack(self._proc)
                self._proc = None
        self.start(ports, env)

    def __enter__(self) -> CoordinatorProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.stop()
        else:
            self.kill()


def start_coordinator(
    tmp_path: Path,
    heartbeat_interval: float = 0.5,
    heartbeat_timeout: float = 3,
    config: str = "",
    prefix_argv: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    ports: tuple[int, int, int] | None = None,
    **opts: Any,
) -> CoordinatorProcess:
    """``init`` a state directory under ``tmp_path`` and ``serve`` it.

    ``prefix_argv`` runs ``serve`` under a prefix (``host.prefix()`` from tests/support/netns.py
    puts it in a network namespace), and the admin commands it runs later too (a store reached
    over the network is reached from the coordinator's host); ``init`` runs here.
    ``config`` is TOML appended to the fresh coordinator.toml (a ``[limits]`` table, say); a state
    directory that already exists keeps its own. ``env``: more environment for this first
    ``serve`` only (a crash point). ``ports``: (api, control, telemetry) to serve on instead of
    free ones. Extra keyword options become ``serve`` flags:
    ``prepare_timeout=5`` -> ``--prepare-timeout 5``.
    """
    state_dir = tmp_path / "coordinator"
    if not (state_dir / "admin.token").exists():
        subprocess.run(
            admin_argv("init", "--state-dir", str(state_dir), *current().init_args()),
            check=True,
            capture_output=True,
            timeout=60,
        )
        with open(state_dir / "coordinator.toml", "a", encoding="utf-8") as toml:
            toml.write(config)
    serve_args = [
        "--heartbeat-interval",
        str(heartbeat_interval),
        "--heartbeat-timeout",
        str(heartbeat_timeout),
    ]
    for name, value in opts.items():
        serve_args += ["--" + name.replace("_", "-"), str(value)]
    proc = CoordinatorProcess(state_dir, serve_args, prefix_argv)
    proc.start(ports, env=env)
    return proc


__all__ = ["CoordinatorProcess", "admin_argv", "start_coordinator", "stored_outputs_service"]


def stored_outputs_service(state_dir: Path, node_id: str) -> tuple[str, str, str]:
    """What the store at ``state_dir`` holds of a Node's outputs listener: address, certificate
    digest and grant key (hex), read-only, as an operator's sqlite3 or psql would see them."""
    (row,) = read(
        where_in(state_dir),
        Store,
        "SELECT outputs_address, outputs_cert_sha256, outputs_grant_key FROM nodes WHERE id = ?",
        (node_id,),
    )
    return (str(row[0]), str(row[1]), str(row[2]))
