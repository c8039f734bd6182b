"""Atomic file writes, one way for every daemon: the agent, the collector, the coordinator, ``tp``.

Rules:
- A file is replaced, never edited: the bytes go to a temporary sibling in the same directory
  (so the rename cannot cross file systems), which is fsynced, renamed over the target, and the
  directory fsynced, so after a crash or a power cut a reader sees the old file or the new one,
  whole, never half of either.
- The file gets exactly ``mode`` (set with ``fchmod``, whatever the umask), before any byte of
  it is written: a credential is never readable by others, not even for a moment.
- A write that fails leaves the target as it was and no temporary file behind.
- The temporary name is ``.<name>.<pid>.<random>.tmp``, created exclusively, so two writers of
  one file (threads or processes) never share one.
- A caller that writes several files and promises nothing until the last is written (Prepare
  answers only after all of a member's files) may hand a :class:`DirSync`: each directory is
  then fsynced once, by :meth:`DirSync.flush`, instead of after every file. The promise is as
  durable; what it saves is one fsync per extra file in a directory.
- Shared runtime infrastructure: it lives in the agent, the lowest layer every daemon imports.
  The runner keeps its own copy (``tuneplane.runner.durable``): it is sealed into
  ``runner.pyz`` and imports nothing outside ``tuneplane.runner``.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in the directory ``path`` survive a power cut."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DirSync:
    """Directories whose entries a batch of writes changed, each fsynced once by :meth:`flush`.

    Nothing written with it is durable before ``flush`` returns: call it before promising
    anything about those files (see the module's rules).
    """

    def __init__(self) -> None:
        self._pending: dict[Path, None] = {}

    def add(self, directory: Path) -> None:
        self._pending[directory] = None

    def flush(self) -> None:
        for directory in list(self._pending):
            fsync_dir(directory)
            del self._pending[directory]


def write_atomic(
    path: Path,
    data: bytes,
    mode: int = 0o644,
    *,
    parents: bool = False,
    dir_sync: DirSync | None = None,
) -> None:
    """Replace ``path`` with ``data`` so a crash leaves the old file or the new one, whole.

    With ``parents``, missing parent directories are made first, durably (each new directory's
    entry fsynced in its own parent), as ``tp`` does for ``experiments/<name>/``. With
    ``dir_sync``, the directories' fsyncs wait for its :meth:`DirSync.flush`.

    Raises the ``OSError`` of the step that failed; ``path`` is then unchanged and no temporary
    file is left (a parent directory made on the way stays).
    """
    if parents:
        make_parents(path, dir_sync)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if dir_sync is None:
        fsync_dir(path.parent)
    else:
        dir_sync.add(path.parent)


def make_parents(path: Path, dir_sync: DirSync | None = None) -> None:
    """Make the missing parent directories of ``path`` durably (see :func:`make_dirs`)."""
    make_dirs(path.parent, dir_sync)


def make_dirs(directory: Path, dir_sync: DirSync | None = None) -> None:
    """Make ``directory`` and its missing parents, and fsync each new entry, top-most first: a
    new directory's entry lives in its parent (with ``dir_sync``, at its flush)."""
    missing = [p for p in (directory, *directory.parents) if not p.exists()]
    directory.mkdir(parents=True, exist_ok=True)
    for created in reversed(missing):
        if dir_sync is None:
            fsync_dir(created.parent)
        else:
            dir_sync.add(created.parent)


def write_json_atomic(
    path: Path, data: Any, mode: int = 0o644, *, dir_sync: DirSync | None = None
) -> None:
    """:func:`write_atomic` of ``data`` as JSON (sorted keys, indented, a final newline)."""
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    write_atomic(path, text.encode(), mode, dir_sync=dir_sync)
