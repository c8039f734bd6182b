"""Durable small files in a member directory: atomic JSON writes and the exclusive launch claim.

Rules: a record is never seen half-written (write tmp, fsync, rename, fsync the directory); the
launch claim is created with O_CREAT|O_EXCL so exactly one runner ever owns a member. Stdlib only:
this module ships inside ``runner.pyz``.

Why a copy of :mod:`tuneplane.agent.atomic_file` (the one atomic write every daemon uses): the
runner is sealed into ``runner.pyz`` with only ``tuneplane.runner`` and ``tuneplane.report`` in it
and runs on the workload's interpreter, so it cannot import the agent
(tests/packaging/test_import_layers.py holds it to that). Keep the two to the same steps.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def fsync_dir(directory: Path) -> None:
    """Make a rename or create inside ``directory`` survive a power cut."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_json_atomic(path: Path, value: Any) -> None:
    """Replace ``path`` with ``value`` as JSON; readers see the old file or the new, never a mix."""
    data = (json.dumps(value, indent=2, sort_keys=True) + "\n").encode("utf-8")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def create_exclusive(path: Path, value: Any) -> None:
    """Create ``path`` holding ``value`` as JSON, failing with FileExistsError if it exists.

    The exclusive create is the claim itself; the content (who claimed, when) follows it and is
    fsynced before this returns, as is the directory entry.
    """
    data = (json.dumps(value, sort_keys=True) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path.parent)


def read_json(path: Path) -> Any:
    """The JSON value in ``path``; FileNotFoundError, ValueError or OSError pass through."""
    with path.open("rb") as f:
        return json.loads(f.read().decode("utf-8"))
