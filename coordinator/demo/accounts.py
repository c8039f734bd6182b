"""The Unix accounts a local cluster's members run as, and whether they can reach their folders.

Rules: accounts are created exactly as docs/operator.md tells a sysadmin to
(``useradd --system --no-create-home --shell /usr/sbin/nologin``), only when missing, and only the
ones created here are ever removed. Whether an account other than the folder's owner can pass
through a folder is read from the folder's "others" execute bit alone: pool accounts share no
group with anything of the Node.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from tuneplane.agent.config import default_policy

USERADD = ("useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin")
# The pool a root agent uses without an [accounts] table: tuneplane-member-0 .. 7.
DEFAULT_POOL: tuple[str, ...] = default_policy(0).pool
# useradd/userdel fail while another process edits /etc/passwd; they are retried this often.
LOCK_ATTEMPTS = 50


class AccountSetupError(RuntimeError):
    """An account could not be created or removed; the message says which and why."""


def missing(names: Iterable[str]) -> list[str]:
    """The accounts of ``names`` that do not exist on this machine, in order."""
    absent = []
    for name in names:
        try:
            pwd.getpwnam(name)
        except KeyError:
            absent.append(name)
    return absent


def _run_locked(argv: Sequence[str]) -> None:
    for _ in range(LOCK_ATTEMPTS):
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=False)
        if done.returncode == 0:
            return
        if "lock" not in done.stderr:
            raise AccountSetupError(
                f"`{' '.join(argv)}` failed with exit {done.returncode}: {done.stderr.strip()}"
            )
        time.sleep(0.1)
    raise AccountSetupError(f"`{' '.join(argv)}` could not lock /etc/passwd; try again.")


def create_missing(names: Iterable[str]) -> list[str]:
    """Create the accounts of ``names`` that are missing (root only); returns those created.

    When one cannot be created, the ones created so far are removed again before the error.
    """
    created: list[str] = []
    try:
        for name in missing(names):
            _run_locked([*USERADD, name])
            created.append(name)
    except AccountSetupError:
        remove(created)
        raise
    return created


def remove(names: Iterable[str]) -> list[str]:
    """``userdel`` each of ``names``; returns a sentence for each one that could not be removed."""
    problems = []
    for name in names:
        try:
            _run_locked(["userdel", name])
        except AccountSetupError as exc:
            problems.append(f"The account {name} was not removed: {exc}")
    return problems


@contextmanager
def throwaway_pool(prefix: str, count: int) -> Iterator[list[str]]:
    """As root, ``count`` fresh accounts named ``<prefix><pid>x<i>``, removed when the block ends.

    Not root: no accounts (members then run as the current user). For benchmarks, which must not
    share the demo's accounts with anything else running on the machine.
    """
    if os.geteuid() != 0:
        yield []
        return
    names = [f"{prefix}{os.getpid()}x{i}" for i in range(count)]
    created = create_missing(names)
    print(f"created {len(created)} member accounts {names[0]} .. {names[-1]} (removed at the end)")
    try:
        yield names
    finally:
        for problem in remove(created):
            print(problem, file=sys.stderr)


def blocking_folder(path: Path) -> Path | None:
    """The first folder from ``/`` down to ``path`` that other accounts cannot pass, if any.

    Folders that do not exist yet are not judged (whoever creates them chooses their mode).
    """
    for folder in (*reversed(path.parents), path):
        try:
            mode = folder.stat().st_mode
        except FileNotFoundError:
            return None
        if not mode & 0o001:
            return folder
    return None


__all__ = [
    "DEFAULT_POOL",
    "USERADD",
    "AccountSetupError",
    "blocking_folder",
    "create_missing",
    "missing",
    "remove",
    "throwaway_pool",
]
