"""Who holds a coordinator's state directory: ``serve``, or a command that must run alone.

Rules:
- ``serve`` holds a shared ``flock`` on ``<state_dir>/serve.lock`` for its whole life, from
  before it opens a store until after it closed them all (:func:`serving`). The kernel drops a
  lock when its holder dies, however it dies, so a lock is never stale.
- A command that must not run beside ``serve`` (``migrate-store``) takes the lock exclusively,
  without waiting (:func:`alone`): while a ``serve`` runs it is refused, and while it holds the
  lock a ``serve`` that starts is refused. Either refusal is :class:`StateDirBusy`, a sentence
  naming who holds the directory and what to do, before anything was touched.
- The file holds nothing the lock needs: the exclusive holder writes its command and pid there
  only so a refused ``serve`` can name it. It is 0600 and never removed (a removed lock file
  would let two holders lock two different files).
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .state_dir import ENDPOINTS, SERVE_LOCK, StateDirError


class StateDirBusy(StateDirError):
    """Another process holds the state directory in a way that excludes this one."""


def _open(state_dir: Path) -> int:
    return os.open(state_dir / SERVE_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


@contextmanager
def serving(state_dir: Path) -> Iterator[None]:
    """Held by ``serve`` for as long as it runs; :class:`StateDirBusy` while a command that
    must run alone holds the directory."""
    fd = _open(state_dir)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "a command"
            raise StateDirBusy(
                f"{holder} holds the state directory {state_dir} and must run alone; wait for "
                "it to finish, then start serve again."
            ) from None
        yield
    finally:
        os.close(fd)


@contextmanager
def alone(state_dir: Path, command: str) -> Iterator[None]:
    """Hold ``state_dir`` so that no ``serve`` runs on it meanwhile; :class:`StateDirBusy` at
    once if one runs now. ``command`` names the holder to a refused ``serve``."""
    fd = _open(state_dir)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StateDirBusy(
                f"A coordinator serve{_pid_text(state_dir)} is running on {state_dir}; "
                f"{command} must run alone. Stop it (`systemctl stop tuneplane-coordinator`, "
                f"or SIGTERM to its pid), then run {command} again. Nothing was changed."
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"`tuneplane-coordinator {command}` (pid {os.getpid()})\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def _pid_text(state_dir: Path) -> str:
    """`` (pid N)`` from the running serve's endpoints.json; "" when it has not written one."""
    try:
        pid = int(json.loads((state_dir / ENDPOINTS).read_text(encoding="utf-8"))["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return f" (pid {pid})"
