"""The runner template: the Node's runner imported once, forking each member's start.

Rules:
- The template runs this agent's own ``runner.pyz`` (:func:`.runner_pyz.build`, written to
  ``<state dir>/runner/runner.pyz``) as ``python runner.pyz --template`` in its own session
  (:mod:`tuneplane.runner.template`). It starts a member only when the capsule's verified runner
  has the template's sha256, so the code that runs is byte for byte the runner Prepare sealed;
  any other capsule's runner starts in a fresh interpreter, as without a template.
- A start through the template is the start ``python <capsule>/runner.pyz <member_dir>`` would
  make (same exit codes, same stderr), less the interpreter's start and the runner's imports.
- Anything wrong with the template (it died, it said something unreadable) ends it, logs why and
  returns None: the launch then starts the capsule's runner the usual way. A start cancelled
  (the launch timed out) kills the template, and with it (parent-death signal) the start it
  forked, as a timed-out runner process is killed.
- It is started when a Prepare arrives, so its imports overlap Prepare and Commit, and it ends
  after :data:`IDLE_S` without a start, or with the agent (EOF on its socket). Its one task is
  owned by the daemon's nursery.
"""

from __future__ import annotations

import array
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import attrs
import trio

from . import runner_pyz
from .atomic_file import write_atomic

log = logging.getLogger(__name__)

#: Where, under the state dir, the template's runner.pyz is written.
RUNNER_TEMPLATE_DIR = "runner"
#: The template ends after this long without a start (a busy Node keeps it; an idle one does not
#: hold a second interpreter).
IDLE_S = 300.0
#: How long a template asked to end may take before it is killed.
CLOSE_TIMEOUT_S = 5.0


class TemplateBroken(Exception):
    """The template is gone or answered something that is not an exit code."""


@attrs.frozen
class StartOutcome:
    """What the forked start did: its exit code and what it wrote on stderr."""

    returncode: int
    stderr: bytes


class RunnerTemplate:
    """One template process at a time, started on demand and ended when idle."""

    def __init__(self, folder: Path, idle_s: float = IDLE_S) -> None:
        self.folder = folder
        self.idle_s = idle_s
        self.process: trio.Process | None = None
        self._sock: trio.socket.SocketType | None = None
        self._buffer = b""
        self._lock = trio.Lock()
        self._last_used = trio.current_time()
        self._wake = trio.Event()

    @property
    def digest(self) -> str:
        """The sha256 of the runner this template runs (the Node's own)."""
        return runner_pyz.own_digest()

    async def warm(self) -> None:
        """Have a template running (a Prepare came: a launch may follow); never raises."""
        async with self._lock:
            self._last_used = trio.current_time()
            try:
                await self._ensure()
            except OSError as exc:
                log.warning("runner template not started reason=%s", exc)
                await self._discard()

    async def start(self, member_dir: Path, digest: str) -> StartOutcome | None:
        """Start ``member_dir``'s runner by a fork of the template; None where it cannot.

        ``digest`` is the sha256 the capsule's runner was verified against.
        """
        if digest != self.digest:
            return None
        async with self._lock:
            self._last_used = trio.current_time()
            try:
                await self._ensure()
                return await self._request(member_dir)
            except (OSError, TemplateBroken) as exc:
                log.warning(
                    "runner template failed; starting the runner in a new interpreter "
                    "member_dir=%s reason=%s",
                    member_dir,
                    exc,
                )
                await self._discard()
                return None

    async def run(self) -> None:
        """End the template once it has been idle for ``idle_s``; until cancelled."""
        try:
            while True:
                if self.process is None:
                    await self._wake.wait()
                    self._wake = trio.Event()
                    continue
                await trio.sleep_until(self._last_used + self.idle_s)
                if trio.current_time() >= self._last_used + self.idle_s:
                    async with self._lock:
                        log.info("runner template idle; ending it idle_s=%g", self.idle_s)
                        await self._discard()
        finally:
            with trio.CancelScope(shield=True):
                await self._discard()

    async def _ensure(self) -> None:
        if self.process is not None and self.process.returncode is None:
            return
        await self._discard()
        path = self.folder / runner_pyz.RUNNER_PYZ
        await trio.to_thread.run_sync(self._write, path)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.process = await trio.lowlevel.open_process(
                [sys.executable, str(path), "--template"],
                stdin=theirs.fileno(),
                stdout=subprocess.DEVNULL,
                start_new_session=True,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock = trio.socket.from_stdlib_socket(ours)
        self._buffer = b""
        self._wake.set()
        log.info("runner template started pid=%d sha256=%s", self.process.pid, self.digest)

    def _write(self, path: Path) -> None:
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        data = runner_pyz.build()
        try:
            if path.read_bytes() == data:
                return
        except FileNotFoundError:
            pass
        write_atomic(path, data, 0o600)

    async def _request(self, member_dir: Path) -> StartOutcome:
        assert self._sock is not None
        read_fd, write_fd = os.pipe()
        try:
            fds = array.array("i", [write_fd])
            await self._sock.sendmsg(
                [f"{member_dir}\n".encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)]
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        chunks: list[bytes] = []
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_read_all, trio.lowlevel.FdStream(read_fd), chunks)
                returncode = await self._number()
        except BaseException:
            # Cancelled (the start timed out) or broken: the start must not go on unseen.
            if self.process is not None:
                self.process.kill()
            with trio.CancelScope(shield=True):
                await self._discard()
            raise
        return StartOutcome(returncode, b"".join(chunks))

    async def _number(self) -> int:
        assert self._sock is not None
        while b"\n" not in self._buffer:
            data = await self._sock.recv(64)
            if not data:
                raise TemplateBroken("the runner template closed its socket")
            self._buffer += data
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            return int(line)
        except ValueError:
            raise TemplateBroken(f"the runner template answered {line[:80]!r}") from None

    async def _discard(self) -> None:
        process, sock = self.process, self._sock
        self.process = self._sock = None
        if sock is not None:
            sock.close()
        await end_template(process, CLOSE_TIMEOUT_S)


async def end_template(process: trio.Process | None, timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for a template told to end (its socket closed), then kill it.
    The collector template (agent/collector_template.py) ends the same way."""
    if process is None:
        return
    with trio.move_on_after(timeout_s):
        await process.wait()
        return
    process.kill()
    await process.wait()


async def _read_all(stream: trio.lowlevel.FdStream, chunks: list[bytes]) -> None:
    async with stream:
        while data := await stream.receive_some():
            chunks.append(data)
