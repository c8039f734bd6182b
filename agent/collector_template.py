"""The collector template: the collector imported once, forking each member's collector.

Rules:
- The template is ``python -m tuneplane.collector.template`` (its protocol is in that module),
  started when a Prepare arrives (:meth:`CollectorTemplate.warm`), so its imports overlap Prepare
  and Commit and a launch's collector costs a fork instead of an interpreter's start and about
  0.5 s of CPU importing trio, grpclib and the protobuf module.
- A collector run through the template behaves as one the agent starts itself: the same
  arguments, environment and output; its exit code returned; cancelled, it gets SIGTERM and
  :data:`STOP_S` to stop before SIGKILL, as :func:`trio.run_process` does.
- Anything wrong with the template (it did not start, died or answered nonsense) ends it and
  logs why; :meth:`run_collector` then returns None and the caller starts that collector itself.
  Collectors it had forked die with it (parent-death signal) and are reported as killed, so the
  supervisor restarts them.
- It ends after :data:`IDLE_S` with no collector running and none started, or with the agent
  (EOF on its socket: its collectors get SIGTERM). Its one task, :meth:`run`, is owned by the
  collector supervisor's nursery; it alone reads the socket.
"""

from __future__ import annotations

import array
import json
import logging
import math
import signal
import socket
import sys

import attrs
import trio

from .runner_template import end_template

log = logging.getLogger(__name__)

#: The template ends after this long without a collector (an idle Node holds no second
#: interpreter; a busy one keeps it).
IDLE_S = 300.0
#: How long the template may take to answer a start before it is taken as broken.
ANSWER_TIMEOUT_S = 30.0
#: How long a cancelled collector has after SIGTERM before SIGKILL (trio.run_process's wait).
STOP_S = 5.0
#: How long an ending template may take before it is killed.
CLOSE_TIMEOUT_S = 10.0
MAX_MESSAGE = 4096


class TemplateBroken(Exception):
    """The template is gone or answered something that is not in its protocol."""


@attrs.define(eq=False)
class _Child:
    pid: int
    done: trio.Event = attrs.field(factory=trio.Event)
    code: int = 0


class CollectorTemplate:
    """One template process at a time, started on demand and ended when idle."""

    def __init__(self, python: str = sys.executable, idle_s: float = IDLE_S) -> None:
        self.python = python
        self.idle_s = idle_s
        self.process: trio.Process | None = None
        self._sock: trio.socket.SocketType | None = None
        self._lock = trio.Lock()
        self._children: dict[int, _Child] = {}
        # Where the reader hands the answer to the one start in progress.
        self._answer: trio.MemorySendChannel[_Child | str] | None = None
        self._last_used = -math.inf
        self._wanted = False
        self._wake = trio.Event()

    def warm(self) -> None:
        """Have a template running soon (a Prepare came: a collector may follow); never blocks."""
        self._wanted = True
        self._last_used = trio.current_time()
        self._wake.set()

    async def run_collector(self, args: list[str], out_fd: int) -> int | None:
        """Run ``tuneplane-collector <args>`` forked from the template, writing to ``out_fd``;
        its exit code, or None when the template cannot start it."""
        child = await self._start(args, out_fd)
        if child is None:
            return None
        try:
            await child.done.wait()
        except BaseException:
            with trio.CancelScope(shield=True):
                await self._stop(child)
            raise
        return child.code

    async def run(self) -> None:
        """Read the template's messages and end it when idle; until cancelled."""
        try:
            while True:
                if self._wanted and self._sock is None:
                    async with self._lock:
                        await self._ensure_or_log()
                self._wanted = False
                sock = self._sock
                if sock is None:
                    await self._wake.wait()
                    self._wake = trio.Event()
                    continue
                idle_at = math.inf if self._children else self._last_used + self.idle_s
                with trio.move_on_at(idle_at):
                    try:
                        self._dispatch(await sock.recv(MAX_MESSAGE))
                    except (OSError, trio.ClosedResourceError, TemplateBroken) as exc:
                        if sock is self._sock:
                            log.warning("collector template failed reason=%s", exc)
                            await end_template(self._detach(), CLOSE_TIMEOUT_S)
                    continue
                if not self._children and trio.current_time() >= self._last_used + self.idle_s:
                    async with self._lock:
                        log.info("collector template idle; ending it idle_s=%g", self.idle_s)
                        await self._discard()
        finally:
            with trio.CancelScope(shield=True):
                await self._discard()

    async def _start(self, args: list[str], out_fd: int) -> _Child | None:
        async with self._lock:
            self._last_used = trio.current_time()
            if not await self._ensure_or_log():
                return None
            assert self._sock is not None
            send, receive = trio.open_memory_channel[_Child | str](1)
            self._answer = send
            try:
                with trio.fail_after(ANSWER_TIMEOUT_S):
                    await self._sock.sendmsg(
                        [json.dumps({"start": args}).encode()],
                        [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [out_fd]))],
                    )
                    answer = await receive.receive()
            except (OSError, trio.ClosedResourceError, trio.TooSlowError, trio.EndOfChannel) as e:
                reason = "it did not answer" if isinstance(e, trio.TooSlowError) else str(e)
                log.warning("collector template failed; starting the collector itself "
                            "reason=%s", reason or "it ended")  # fmt: skip
                await self._discard()
                return None
            finally:
                self._answer = None
            if isinstance(answer, str):
                log.warning("collector template refused a start reason=%s", answer)
                return None
            self._last_used = trio.current_time()
            return answer

    async def _stop(self, child: _Child) -> None:
        """SIGTERM, then SIGKILL after :data:`STOP_S`, as trio.run_process stops a process."""
        for signum in (signal.SIGTERM, signal.SIGKILL):
            if child.done.is_set() or self._sock is None:
                return
            message = json.dumps({"signal": child.pid, "signum": int(signum)}).encode()
            try:
                await self._sock.send(message)
            except (OSError, trio.ClosedResourceError):
                return
            with trio.move_on_after(STOP_S):
                await child.done.wait()

    def _dispatch(self, data: bytes) -> None:
        if not data:
            raise TemplateBroken("the collector template closed its socket")
        try:
            message = json.loads(data)
        except ValueError:
            message = None
        if not isinstance(message, dict):
            raise TemplateBroken(f"the collector template sent {data[:80]!r}")
        if "exited" in message:
            pid, code = message["exited"], message.get("code")
            child = self._children.pop(pid, None) if isinstance(pid, int) else None
            if child is not None and isinstance(code, int):
                child.code = code
                child.done.set()
            return
        answer: _Child | str
        if isinstance(message.get("started"), int):
            answer = self._children[message["started"]] = _Child(message["started"])
        else:
            answer = str(message.get("refused", data[:80]))
        if self._answer is None:
            raise TemplateBroken(f"the collector template sent {data[:80]!r} unasked")
        self._answer.send_nowait(answer)

    async def _ensure_or_log(self) -> bool:
        """A template running (the lock held); False, logged, when it cannot be started."""
        if self.process is not None and self.process.returncode is None:
            return True
        await self._discard()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = await trio.lowlevel.open_process(
                [self.python, "-m", "tuneplane.collector.template"],
                stdin=theirs.fileno(),
                start_new_session=True,
            )
        except OSError as exc:
            ours.close()
            log.warning("collector template not started reason=%s", exc)
            return False
        finally:
            theirs.close()
        self._sock = trio.socket.from_stdlib_socket(ours)
        self._wake.set()
        log.info("collector template started pid=%d", self.process.pid)
        return True

    def _detach(self) -> trio.Process | None:
        """Forget the template at once: a start waiting for it gives up, and its collectors are
        reported killed (-9): its end ends them, by SIGTERM from it or, when it died, by the
        kernel's SIGKILL. Returns its process, to be waited for."""
        process, sock = self.process, self._sock
        self.process = self._sock = None
        if self._answer is not None:
            self._answer.close()
        for child in self._children.values():
            child.code = -signal.SIGKILL
            child.done.set()
        self._children.clear()
        if sock is not None:
            sock.close()
        return process

    async def _discard(self) -> None:
        """End the template: EOF on its socket, and its collectors get SIGTERM from it."""
        await end_template(self._detach(), CLOSE_TIMEOUT_S)
