"""Write an artifact manifest: what a member left in its output directory when it ended.

Rules:
- A named lifecycle step, run once when the agent observes a member's exit and before the exit
  is journaled; idempotent (the same directory gives the same bytes, written again atomically),
  so a crash between writing and journaling only means it is written again on replay.
- The manifest lists every regular file under ``$TUNEPLANE_OUT_DIR`` by relative path, size and
  sha256, sorted by path. Symbolic links, devices, sockets, files with more than one hard link (a
  link could name a file the member does not own) and names that are not plain text are left
  out, and said so in ``skipped``.
- It is bounded: at most :data:`MAX_FILES` files and :data:`MAX_BYTES` bytes. Past either bound
  no manifest is written and the summary carries the sentence saying why (such a run cannot
  seed a Derivation).
- It lives beside the output directory, at ``<out_dir>.manifest.json`` (0600, root's), in the
  root-owned attempt directory a workload cannot write; its own sha256 is reported to the
  coordinator.
- Pure of the event loop: :func:`write_manifest` does blocking I/O and runs in a worker thread.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

import attrs

from tuneplane.proto.contract.derivation_source import ManifestSummary, manifest_path
from tuneplane.proto.contract.input_checks import InputRefused, check_file_name

from .atomic_file import write_atomic
from .crashpoint import crashpoint

FORMAT = "tuneplane/output-manifest-1"
MAX_FILES = 10_000
MAX_BYTES = 256 * 1024**3
#: A manifest of MAX_FILES entries with long names stays far below this; a larger file is refused.
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
CHUNK_BYTES = 1024 * 1024


class ManifestProblem(Exception):
    """No manifest can be written or read; ``str()`` is a sentence naming the file and why."""


@attrs.frozen
class Entry:
    path: str
    size: int
    sha256: str


@attrs.frozen
class Manifest:
    run_id: str
    attempt: int
    member_index: int
    files: tuple[Entry, ...]
    skipped: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.files)

    def encode(self) -> bytes:
        data: dict[str, Any] = {
            "format": FORMAT,
            "run_id": self.run_id,
            "attempt": self.attempt,
            "member_index": self.member_index,
            "files": [attrs.asdict(e) for e in self.files],
            "bytes": self.total_bytes,
            "skipped": list(self.skipped),
        }
        return (json.dumps(data, sort_keys=True, indent=1) + "\n").encode()


class NotRegular(OSError):
    """The path names something other than a regular file (a link, a FIFO, a device)."""


def open_regular(path: Path) -> int:
    """A read-only descriptor of the regular file at ``path``: a final link is not followed and
    a FIFO or device never blocks the open (it is refused with :class:`NotRegular`)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotRegular(f"{path} is not a regular file")
    os.set_blocking(fd, True)
    return fd


def sha256_file(path: Path) -> tuple[int, str]:
    """Size and sha256 of the regular file at ``path``, read without following a final link."""
    digest = hashlib.sha256()
    size = 0
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def scan(
    out_dir: Path,
    run_id: str,
    attempt: int,
    member_index: int,
    max_files: int = MAX_FILES,
    max_bytes: int = MAX_BYTES,
) -> Manifest:
    """Hash every regular file under ``out_dir``; :class:`ManifestProblem` past a bound."""
    found: list[tuple[str, Path]] = []
    skipped: list[str] = []
    total = 0
    if not out_dir.is_dir():
        return Manifest(run_id, attempt, member_index, ())
    for folder, dirs, files in os.walk(out_dir, followlinks=False):
        dirs.sort()
        base = Path(folder)
        for name in sorted(files):
            path = base / name
            rel = path.relative_to(out_dir).as_posix()
            try:
                check_file_name(rel, "An output file name")
            except InputRefused:
                skipped.append(f"{rel!r}: not a plain relative name")
                continue
            info = os.lstat(path)
            if not stat.S_ISREG(info.st_mode):
                skipped.append(f"{rel}: not a regular file")
                continue
            if info.st_nlink > 1:
                skipped.append(f"{rel}: has {info.st_nlink} hard links")
                continue
            found.append((rel, path))
            total += info.st_size
            if len(found) > max_files:
                raise ManifestProblem(
                    f"the output directory {out_dir} holds more than {max_files} files, the "
                    "most a manifest lists; keep checkpoints in fewer, larger files"
                )
            if total > max_bytes:
                raise ManifestProblem(
                    f"the output directory {out_dir} holds more than {max_bytes} bytes, the "
                    "most a manifest covers"
                )
        # Links to directories are listed in dirs but never entered (followlinks=False).
        for name in list(dirs):
            if (base / name).is_symlink():
                skipped.append(f"{(base / name).relative_to(out_dir).as_posix()}: a link")
                dirs.remove(name)
    entries = []
    for rel, path in sorted(found):
        size, digest = sha256_file(path)
        entries.append(Entry(rel, size, digest))
    return Manifest(run_id, attempt, member_index, tuple(entries), tuple(skipped))


def write_manifest(
    out_dir: Path,
    run_id: str,
    attempt: int,
    member_index: int,
    max_files: int = MAX_FILES,
    max_bytes: int = MAX_BYTES,
) -> ManifestSummary:
    """Write ``<out_dir>.manifest.json`` atomically and return its summary (or the problem)."""
    target = Path(manifest_path(str(out_dir)))
    try:
        manifest = scan(out_dir, run_id, attempt, member_index, max_files, max_bytes)
    except ManifestProblem as exc:
        target.unlink(missing_ok=True)
        return ManifestSummary(problem=f"{str(exc).rstrip('.')}.")
    except OSError as exc:
        target.unlink(missing_ok=True)
        return ManifestSummary(
            problem=f"the output directory {out_dir} could not be read ({exc.strerror or exc})."
        )
    data = manifest.encode()
    try:
        # 0600 root: the attempt folder is passable (0711), and a manifest names another
        # member's files.
        write_atomic(target, data, 0o600)
    except OSError as exc:
        # A full disk, an out root gone: the exit must still be journaled and reported.
        return ManifestSummary(
            problem=f"the manifest {target} could not be written ({exc.strerror or exc})."
        )
    crashpoint("after-manifest-written")
    return ManifestSummary(
        len(manifest.files), manifest.total_bytes, hashlib.sha256(data).hexdigest()
    )


def read_manifest(data: bytes, where: str) -> Manifest:
    """Parse a manifest's bytes (already checked against their digest); every path is a plain
    relative name. :class:`ManifestProblem` names ``where`` when it is not one."""
    try:
        raw = json.loads(data)
        if raw.get("format") != FORMAT:
            raise ValueError(f"format is {raw.get('format')!r}, not {FORMAT}")
        entries = []
        for item in raw["files"]:
            path, size, digest = item["path"], item["size"], item["sha256"]
            if not (isinstance(path, str) and isinstance(size, int) and isinstance(digest, str)):
                raise TypeError(f"the entry {item!r} is not a path, a size and a sha256")
            check_file_name(path, "A manifest path")
            entries.append(Entry(path, size, digest))
        return Manifest(
            str(raw["run_id"]), int(raw["attempt"]), int(raw["member_index"]), tuple(entries)
        )
    except InputRefused as exc:
        raise ManifestProblem(f"The output manifest {where} is unusable: {exc}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ManifestProblem(f"The output manifest {where} cannot be read: {exc}.") from None
