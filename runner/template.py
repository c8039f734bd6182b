"""``python runner.pyz --template``: the runner, imported once, forking each member's start.

Rules: the agent starts one template per agent process from the Node's own ``runner.pyz`` and
holds the other end of the socket on the template's stdin. For each request (a member directory,
with the write end of a pipe passed beside it) the template forks a child that is exactly the
process ``python runner.pyz <member_dir>`` would have been, but without an interpreter start
and the runner's imports: stderr is that pipe, stdin and stdout are ``/dev/null``, and it runs
:func:`.main.main`, which claims the launch, forks the detached runner and exits once every
local process started (or refused). The template waits for that child and answers its exit
code, one line per request, in order; the runner itself is the child's child, in its own
session, so neither the template nor the agent ever waits on the member. The child dies with
the template (the agent kills the template when a start times out, as it would kill a runner
process that did not answer), which its own child, the runner, does not inherit. The template
does no work of its own: it ends when the agent closes its end (EOF), and nothing it holds is
needed by a runner it forked. Stdlib only: this ships inside ``runner.pyz``.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import traceback

from .exit_codes import EXIT_FAILED
from .main import main
from .prctl import die_with_parent, set_name

#: The process name of a start forked from the template, and of the runner it forks.
RUNNER_NAME = "tp-runner"
# A member directory is a path; more than this is not a request from the agent.
MAX_REQUEST = 4096


def serve(sock: socket.socket) -> int:
    """Answer start requests on ``sock`` until the agent closes it; returns the exit code."""
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST, 1)
        except ConnectionResetError:
            return 0
        if not data:
            for fd in fds:
                os.close(fd)
            return 0
        member_dir = data.decode("utf-8", "replace").strip()
        if len(fds) != 1 or not member_dir:
            for fd in fds:
                os.close(fd)
            code = EXIT_FAILED
        else:
            code = _start(sock, member_dir, fds[0])
        try:
            sock.sendall(f"{code}\n".encode())
        except (BrokenPipeError, ConnectionResetError):
            # The agent went while the start ran: the runner stands on its own records.
            return 0


def _start(sock: socket.socket, member_dir: str, stderr_fd: int) -> int:
    """Fork the child that runs ``main([member_dir])``; its exit code once it exited."""
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        code = EXIT_FAILED
        try:
            die_with_parent()
            if os.getppid() != parent:
                # The template died before the line above: nobody waits for this start.
                os._exit(EXIT_FAILED)
            sock.close()
            # The runner it forks keeps the name: in ps its command line is the template's.
            set_name(RUNNER_NAME)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)
            os.dup2(null, 1)
            os.dup2(stderr_fd, 2)
            os.close(null)
            os.close(stderr_fd)
            code = main([member_dir])
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(stderr_fd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def run_template() -> int:
    """The template's main: its socket is stdin (fd 0), handed over by the agent."""
    # Ctrl-C at an agent in the foreground is the agent's to handle; EOF ends the template.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=os.dup(0))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    with sock:
        return serve(sock)
