"""``python -m tuneplane.collector.template``: the collector, imported once, forking each
member's collector.

Rules:
- The agent starts one template at a time and holds the other end of its socket (a
  ``SOCK_SEQPACKET`` pair, the template's stdin). Each message is one JSON object:
  - agent -> template: ``{"start": [args…]}`` with one file descriptor beside it (the collector's
    stdout and stderr), answered ``{"started": pid}`` or ``{"refused": sentence}``, in order;
    ``{"signal": pid, "signum": n}``, unanswered, sent on only to a child not yet reaped, so a
    reused pid is never signalled;
  - template -> agent: ``{"exited": pid, "code": n}`` once a child is reaped (``n`` as
    :func:`os.waitstatus_to_exitcode` gives it: negative for a signal).
- A child is exactly ``tuneplane-collector <args…>`` less the interpreter's start and the imports
  of ``run``: stdin is ``/dev/null``, stdout and stderr the descriptor passed, the environment the
  template's (the agent's), its process name ``tp-collector`` (``ps -o comm``); it dies with the
  template (parent-death signal), so a collector is never left running unseen by the agent. Its
  parent is the template, which ends with the agent: started without ``--agent-pid``, the
  collector watches its parent (collector/service.py) and stops when the template has gone.
- The template does no work of its own and starts no thread, so a fork is safe. It ends when the
  agent closes its end (EOF): it sends SIGTERM to its children (a collector resumes from its spool
  next time), waits :data:`CLOSE_S` for them, kills what is left and exits.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import sys
import time
import traceback

from tuneplane.runner.prctl import die_with_parent, set_name

#: What ``tuneplane-collector run`` imports before it follows a file: imported once, here.
RUN_MODULES = (
    "trio",
    "tuneplane.collector.cli",
    "tuneplane.collector.checkpoint",
    "tuneplane.collector.files",
    "tuneplane.collector.options",
    "tuneplane.collector.service",
    "tuneplane.collector.ship_wire",
    "tuneplane.collector.spool",
    "tuneplane.collector.system_sampler",
)
#: The process name of a collector forked from the template.
COLLECTOR_NAME = "tp-collector"
#: How long the children of an ending template have after SIGTERM before they are killed.
CLOSE_S = 5.0
# A request is an argument list of paths and names; more than this is not from the agent.
MAX_MESSAGE = 1 << 16


class _Template:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.children: set[int] = set()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)

    def send(self, message: dict[str, object]) -> None:
        self.sock.send(json.dumps(message).encode())

    def serve(self) -> int:
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        signal.set_wakeup_fd(self.wake_w)
        try:
            while True:
                sock = self.sock.fileno()
                readable, _, _ = select.select([sock, self.wake_r], [], [])
                if self.wake_r in readable:
                    while _read_some(self.wake_r):
                        pass
                    self.reap()
                if sock in readable and not self.handle():
                    return 0
        except (BrokenPipeError, ConnectionResetError):
            return 0
        finally:
            self.end_children()

    def handle(self) -> bool:
        """One message from the agent; False at EOF."""
        try:
            data, fds, _, _ = socket.recv_fds(self.sock, MAX_MESSAGE, 1)
        except ConnectionResetError:
            return False
        if not data:
            for fd in fds:
                os.close(fd)
            return False
        try:
            message = json.loads(data)
        except ValueError:
            message = None
        if isinstance(message, dict) and "start" in message:
            args = message["start"]
            if (
                len(fds) != 1
                or not isinstance(args, list)
                or not all(isinstance(a, str) for a in args)
            ):
                for fd in fds:
                    os.close(fd)
                self.send({"refused": "a start needs its arguments and one output descriptor"})
            else:
                self.send({"started": self.fork(args, fds[0])})
            return True
        for fd in fds:
            os.close(fd)
        if isinstance(message, dict) and message.get("signal") in self.children:
            signum = message.get("signum")
            if isinstance(signum, int):
                os.kill(int(message["signal"]), signum)
        return True

    def fork(self, args: list[str], out_fd: int) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            _child(parent, args, out_fd, (self.sock.fileno(), self.wake_r, self.wake_w))
        os.close(out_fd)
        self.children.add(pid)
        return pid

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)
            self.send({"exited": pid, "code": os.waitstatus_to_exitcode(status)})

    def end_children(self) -> None:
        for pid in self.children:
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + CLOSE_S
        while self.children and time.monotonic() < deadline:
            pid, _ = os.waitpid(-1, os.WNOHANG)
            if pid:
                self.children.discard(pid)
            else:
                time.sleep(0.05)
        for pid in self.children:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def _read_some(fd: int) -> bool:
    try:
        return bool(os.read(fd, 512))
    except BlockingIOError:
        return False


def _child(parent: int, args: list[str], out_fd: int, template_fds: tuple[int, ...]) -> None:
    """The forked collector: runs ``tuneplane-collector <args>`` and never returns."""
    code = 1
    try:
        die_with_parent()
        if os.getppid() != parent:
            # The template died before the line above: nobody would see this collector.
            os._exit(1)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        # As in a fresh interpreter: Trio turns SIGINT into KeyboardInterrupt only then.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in template_fds:
            os.close(fd)
        set_name(COLLECTOR_NAME)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        sys.argv = ["tuneplane-collector", *args]
        from tuneplane.collector.cli import main

        # Standalone, click always ends with SystemExit (0 when the command returned).
        main.main(args=args, prog_name="tuneplane-collector")
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _exit_code(value: object) -> int:
    """What the interpreter would exit with for ``sys.exit(value)``."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def run_template() -> int:
    """The template's main: its socket is stdin (fd 0), handed over by the agent."""
    # Ctrl-C at an agent in the foreground is the agent's to handle; EOF ends the template.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in RUN_MODULES:
        importlib.import_module(name)
    # What the first ship would build in every child is built once, here.
    importlib.import_module("tuneplane.collector.ship_wire").warm_messages()
    sock = socket.socket(fileno=os.dup(0))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    with sock:
        return _Template(sock).serve()


if __name__ == "__main__":
    sys.exit(run_template())
