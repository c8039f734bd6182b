"""Which files hold telemetry, the decoder for each, and reading a whole file once.

Rules:
- TensorBoard event files are recognised as TensorBoard does (``tfevents`` in the name); JSONL
  files by ``.jsonl`` in the name, so rotated copies (``metrics.jsonl.1``) are still followed.
  Compressed rotations (``.gz``, ``.bz2``, ``.xz``, ``.zst``) are not telemetry.
- Under a member's output directory (a :class:`Layout` with a telemetry directory inside it),
  any ``.jsonl`` counts only inside the telemetry directory; elsewhere only the files
  ``tuneplane.report`` writes (``report.rank<N>.jsonl`` and their rotations) do, so a
  researcher's own ``.jsonl`` data is never read as metrics. Event files count anywhere.
- A file's *run* is its directory relative to the nearest log directory (the telemetry or
  TensorBoard directory, else the root), as TensorBoard names runs; the tailer puts it in
  front of the file's tags.
- Discovery is bounded (:class:`ScanLimits`: depth and directory entries per scan) and walks
  the log directories first, so a large checkpoint tree cannot hide them. It never follows a
  symbolic link, and only regular files are opened (a FIFO named like telemetry never blocks).
- Reading is chunked; a decoder never sees more than one chunk plus its unconsumed rest.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any, Literal

import attrs

from .defaults import (
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_ENTRIES,
    DEFAULT_MAX_FILES,
    TELEMETRY_SUBDIR,
    TENSORBOARD_SUBDIR,
)
from .jsonl import JsonlDecoder
from .points import (
    Decoded,
    Decoder,
    HParamsMark,
    Mark,
    ReadWarning,
    RestartMark,
    ScalarColumns,
    ScalarPoint,
)
from .tfevent import TFEventDecoder

Kind = Literal["tfevents", "jsonl"]
CHUNK_BYTES = 4 * 1024 * 1024
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst")
# What tuneplane.report writes (runner/report): report.rank<RANK>.jsonl, and its rotations.
_REPORT_NAME = re.compile(r"report\.rank[0-9]+\.jsonl(\.[0-9]+)?")


class TelemetryPathError(ValueError):
    """A path given to a reader is not a telemetry file or directory."""


def kind_of(name: str) -> Kind | None:
    """The format of a file by its base name, or None when it is not telemetry."""
    base = os.path.basename(name)
    if base.endswith(_COMPRESSED) or base.startswith("."):
        return None
    if "tfevents" in base:
        return "tfevents"
    if ".jsonl" in base:
        return "jsonl"
    return None


def make_decoder(
    kind: Kind, source: str, source_id: str = "", state: dict[str, Any] | None = None
) -> Decoder:
    if kind == "tfevents":
        return TFEventDecoder(source, source_id, state)
    return JsonlDecoder(source, source_id, state)


def telemetry_files(root: Path) -> Iterator[Path]:
    """Every telemetry file under ``root`` (recursively), in a stable order."""
    for directory, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            if kind_of(name) is not None:
                yield Path(directory) / name


@attrs.frozen
class Layout:
    """Where telemetry lives under a tailer's root, as paths relative to it ("" is the root).

    ``telemetry``: the telemetry directory, where every ``.jsonl`` counts. ``tensorboard``: the
    directory ``TENSORBOARD_LOGDIR`` names, or None. Files elsewhere under the root count when
    they are event files or ``tuneplane.report``'s own JSONL.
    """

    telemetry: str = ""
    tensorboard: str | None = None

    @classmethod
    def output_dir(
        cls, telemetry: str = TELEMETRY_SUBDIR, tensorboard: str = TENSORBOARD_SUBDIR
    ) -> Layout:
        """A member's ``$TUNEPLANE_OUT_DIR`` with its telemetry and TensorBoard directories."""
        return cls(telemetry, tensorboard)

    def log_dirs(self) -> tuple[str, ...]:
        """The log directories, nearest-first candidates for naming runs; the root last."""
        dirs = [self.telemetry]
        if self.tensorboard is not None:
            dirs.append(self.tensorboard)
        return (*(d for d in dirs if d), "")

    def kind(self, path: str) -> Kind | None:
        """The format of the file at ``path`` (relative, '/'-separated), or None when it is not
        followed here."""
        found = kind_of(path)
        if found != "jsonl" or _inside(path, self.telemetry):
            return found
        return "jsonl" if _REPORT_NAME.fullmatch(os.path.basename(path)) else None

    def run(self, path: str) -> str:
        """The run a file belongs to: its directory relative to the nearest log directory."""
        directory = os.path.dirname(path)
        for base in self.log_dirs():
            if _inside(path, base):
                return directory[len(base) :].lstrip("/") if base else directory
        return directory


def points_in_run(run: str, points: Sequence[ScalarPoint]) -> list[ScalarPoint]:
    """``points`` with ``run`` in front of their tags (unchanged when ``run`` is "")."""
    if not run:
        return list(points)
    return [attrs.evolve(p, tag=f"{run}/{p.tag}") for p in points]


def mark_in_run(run: str, mark: Mark) -> Mark:
    """``mark`` with the tags it names in ``run``, as its file's points are."""
    if run and isinstance(mark, RestartMark) and mark.tags is not None:
        return attrs.evolve(mark, tags=tuple(f"{run}/{t}" for t in mark.tags))
    if run and isinstance(mark, HParamsMark) and mark.metrics:
        return attrs.evolve(mark, metrics=tuple(f"{run}/{t}" for t in mark.metrics))
    return mark


def _inside(path: str, base: str) -> bool:
    return not base or path.startswith(base + "/")


@attrs.frozen
class ScanLimits:
    """Bounds on one member's discovery: ``max_files`` streams followed at once, directories at
    most ``max_depth`` below the root, at most ``max_entries`` directory entries per scan."""

    max_files: int = DEFAULT_MAX_FILES
    max_depth: int = DEFAULT_MAX_DEPTH
    max_entries: int = DEFAULT_MAX_ENTRIES


@attrs.frozen
class Discovery:
    """One scan: telemetry files (relative path, kind) in walk order, and which bound, if any,
    left part of the tree unseen (``depth_limited``: a directory too deep; ``entries_limited``:
    the scan stopped after ``max_entries``)."""

    files: list[tuple[str, Kind]]
    depth_limited: bool = False
    entries_limited: bool = False


def discover(root: Path, layout: Layout, limits: ScanLimits) -> Discovery:
    """Walk ``root`` within ``limits``: the log directories first, then the rest, each in name
    order; symbolic links are neither followed nor reported."""
    files: list[tuple[str, Kind]] = []
    budget = limits.max_entries
    depth_limited = False
    starts = [d for d in layout.log_dirs() if d]
    for start in [*starts, ""]:
        # Depth-first, name order; ``pending`` holds (relative directory, depth).
        pending = [(start, start.count("/") + 1 if start else 0)]
        while pending:
            rel, depth = pending.pop()
            fd = _open_dir(root, rel)
            if fd is None:
                continue
            try:
                with os.scandir(fd) as listing:
                    entries = sorted(listing, key=lambda e: e.name)
                if len(entries) > budget:
                    entries = entries[:budget]
                budget -= len(entries)
                below: list[tuple[str, int]] = []
                for entry in entries:
                    path = f"{rel}/{entry.name}" if rel else entry.name
                    try:
                        if entry.is_symlink():
                            continue
                        if entry.is_dir(follow_symlinks=False):
                            if path in starts:
                                continue  # a log directory, walked on its own
                            if depth + 1 > limits.max_depth:
                                depth_limited = True
                            else:
                                below.append((path, depth + 1))
                            continue
                    except OSError:
                        continue
                    kind = layout.kind(path)
                    if kind is not None:
                        files.append((path, kind))
            except OSError:
                continue
            finally:
                os.close(fd)
            pending.extend(reversed(below))
            if budget <= 0:
                return Discovery(files, depth_limited, entries_limited=True)
    return Discovery(files, depth_limited)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_dir(root: Path, rel: str) -> int | None:
    """A descriptor of ``root/rel``, reached one part at a time without following a symbolic
    link (a workload may swap a directory for a link at any moment), or None."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    for part in rel.split("/") if rel else ():
        try:
            inner = os.open(part, _DIR_FLAGS, dir_fd=fd)
        except OSError:
            os.close(fd)
            return None
        os.close(fd)
        fd = inner
    return fd


def open_under(root: Path, rel: str) -> IO[bytes] | None:
    """The regular file ``root/rel`` opened for reading, or None when it is gone, is not a
    regular file, or a part of ``rel`` is a symbolic link.

    Non-blocking open, so a FIFO that a workload named like telemetry cannot hang the reader.
    """
    parent, _, name = rel.rpartition("/")
    dir_fd = _open_dir(root, parent)
    if dir_fd is None:
        return None
    try:
        fd = os.open(
            name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd
        )
    except OSError:  # gone, a directory, or ELOOP: a symbolic link
        return None
    finally:
        os.close(dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
    except OSError:
        os.close(fd)
        return None
    return os.fdopen(fd, "rb")


def read_chunks(
    handle: Any, decoder: Decoder, start: int, *, final: bool, limit: int | None = None
) -> Iterator[Decoded]:
    """Feed ``handle`` from byte ``start`` to its end through ``decoder``.

    Yields one :class:`Decoded` per chunk whose ``consumed`` is absolute: the stream position
    the caller may resume from (``handle.tell()`` is how far was read). ``limit`` bounds how far
    decoding advances in one call, but a record larger than it is still read to its end. With
    ``final`` the last chunk reports an incomplete tail.
    """
    handle.seek(start)
    pending = b""
    position = start
    while limit is None or position - start < limit:
        chunk = handle.read(CHUNK_BYTES)
        at_end = not chunk
        if at_end and not final:
            return
        data = pending + chunk if pending else chunk
        if not data:
            return
        decoded = decoder.feed(data, position, final=final and at_end)
        position += decoded.consumed
        pending = data[decoded.consumed :]
        yield Decoded(decoded.points, decoded.warnings, position, decoded.marks)
        if at_end:
            return


def read_file(path: Path, source: str) -> tuple[ScalarColumns, list[ReadWarning]]:
    """Decode a whole file as the collector would, treating it as finished."""
    kind = kind_of(path.name)
    if kind is None:
        raise TelemetryPathError(
            f"{path} is not a telemetry file: names must contain 'tfevents' (TensorBoard) or "
            "'.jsonl' (JSON lines). Rename it or point at its directory"
        )
    decoder = make_decoder(kind, source)
    points = ScalarColumns(decoder.source, decoder.source_id)
    warnings: list[ReadWarning] = []
    with path.open("rb") as handle:
        for decoded in read_chunks(handle, decoder, 0, final=True):
            if isinstance(decoded.points, ScalarColumns):
                points.extend(decoded.points)
            else:
                for p in decoded.points:
                    points.add(p.tag, p.step, p.wall_time, p.value, p.offset, p.index)
            warnings += decoded.warnings
    return points, warnings
