"""The Linux ``prctl`` calls the runner makes: the child subreaper and no new privileges.

Rules: a failed call raises OSError with the option's name; nothing here is retried. Stdlib
only: this ships inside ``runner.pyz``.
"""

from __future__ import annotations

import ctypes

_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, what: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({what}) failed")


def no_new_privileges() -> None:
    """``prctl(PR_SET_NO_NEW_PRIVS)``: exec can never gain privileges again (no setuid binaries)."""
    _prctl(_PR_SET_NO_NEW_PRIVS, "PR_SET_NO_NEW_PRIVS")


def become_child_subreaper() -> None:
    """``prctl(PR_SET_CHILD_SUBREAPER)``: orphaned descendants become this process's children."""
    _prctl(_PR_SET_CHILD_SUBREAPER, "PR_SET_CHILD_SUBREAPER")
