"""The Linux ``prctl`` calls the runner makes: the child subreaper, no new privileges and the
parent-death signal.

Rules: a failed call raises OSError with the option's name; nothing here is retried. Stdlib
only: this ships inside ``runner.pyz``.
"""

from __future__ import annotations

import ctypes
import signal

_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def _prctl(option: int, what: str, value: int = 1) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({what}) failed")


def no_new_privileges() -> None:
    """``prctl(PR_SET_NO_NEW_PRIVS)``: exec can never gain privileges again (no setuid binaries)."""
    _prctl(_PR_SET_NO_NEW_PRIVS, "PR_SET_NO_NEW_PRIVS")


def become_child_subreaper() -> None:
    """``prctl(PR_SET_CHILD_SUBREAPER)``: orphaned descendants become this process's children."""
    _prctl(_PR_SET_CHILD_SUBREAPER, "PR_SET_CHILD_SUBREAPER")


def die_with_parent() -> None:
    """``prctl(PR_SET_PDEATHSIG, SIGKILL)``: killed with the parent; a fork does not keep it."""
    _prctl(_PR_SET_PDEATHSIG, "PR_SET_PDEATHSIG", signal.SIGKILL)


def set_name(name: str) -> None:
    """``prctl(PR_SET_NAME)``: the process name ``ps -o comm`` and ``top`` show (15 bytes)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NAME) failed")
