"""Materialise a Derivation's source at Prepare: copy another run's outputs, verified.

Rules:
- A named Prepare step (:func:`materialise_init_from`), run in a worker thread beside the rest of
  the member's files, before the work directory is given to the member's account.
- The source is the directory the resolved JobSpec names (``init_from_source.out_dir``), which
  must lie inside this Node's own output root: a Fleet with a ``shared_output_root`` has every
  Node use that shared mount as its out root. Nothing outside it is ever read.
- The manifest beside it must have the sha256 the coordinator recorded when the source member
  ended; every file it lists is copied (never linked: the copy becomes the new member's, the
  source stays untouched) while being hashed, and must have the listed size and sha256. A
  missing, changed or extra-long file refuses the Prepare with a sentence naming the file.
- Crash-safe: everything is written under ``<dest>.partial`` (removed first if a crash left one,
  and when the step is refused), each file fsynced, then renamed to ``<dest>`` in one step.
  Repeating the step redoes it.
- Fetched (``init_from_source.node_id`` names another Node, or this one but outside its output
  root): the files come from the holder's outputs listener (:mod:`.outputs_fetch`), with the
  address, pinned certificate digest and grant the Prepare carried (``InitFromFetch``). The
  manifest and every file go through the same checks as a local copy (:func:`copy_checked` is
  the one place that hashes and counts); any failure refuses the Prepare naming the run, the
  holder and its address.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import BinaryIO, Protocol

from tuneplane.proto.contract.derivation_source import InitFromSource, manifest_path

from . import outputs_fetch
from .atomic_file import fsync_dir
from .crashpoint import crashpoint
from .messages import InitFromFetch
from .outputs_manifest import (
    CHUNK_BYTES,
    MAX_MANIFEST_BYTES,
    Entry,
    Manifest,
    ManifestProblem,
    NotRegular,
    open_regular,
    read_manifest,
)
from .prepare import PrepareRefused
from .runner_pyz import CAPSULE_DIR

#: Where the source's files land, relative to the member's work directory; the workload finds
#: them through ``$TUNEPLANE_INIT_FROM_DIR``.
INIT_FROM_DIR = Path(CAPSULE_DIR).parent / "init-from"
ENV_NAME = "TUNEPLANE_INIT_FROM_DIR"


class Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


class SourceUnreadable(Exception):
    """A file of a source member's outputs cannot be opened; ``str()`` is a sentence naming it."""


def _inside(path: Path, root: Path) -> bool:
    real = Path(os.path.realpath(path))
    base = Path(os.path.realpath(root))
    return real == base or base in real.parents


def read_manifest_file(path: Path, limit: int = MAX_MANIFEST_BYTES) -> bytes:
    """The bytes of the manifest at ``path`` (a regular file, no final link), at most ``limit``."""
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ManifestProblem(f"The output manifest {path} is larger than {limit} bytes.")
    return data


def open_source_file(src: Path, rel: str, run: str) -> BinaryIO:
    """The regular file ``src/rel`` opened for reading, never through a link out of ``src``.

    Raises :class:`SourceUnreadable` with a sentence naming ``rel`` and ``run``.
    """
    origin = src / rel
    if not _inside(origin.parent, src):
        raise SourceUnreadable(
            f"The file {rel} of {run}'s outputs lies behind a link out of {src}; refused."
        )
    try:
        fd = open_regular(origin)
    except NotRegular:
        raise SourceUnreadable(
            f"The file {rel} of {run}'s outputs is not a regular file any more; refused."
        ) from None
    except FileNotFoundError:
        raise SourceUnreadable(
            f"The file {rel} of {run}'s outputs is missing from {src}; the manifest lists it."
        ) from None
    except OSError as exc:
        raise SourceUnreadable(
            f"The file {rel} of {run}'s outputs cannot be opened ({exc.strerror}); a link or "
            "an unreadable file is refused."
        ) from None
    return os.fdopen(fd, "rb")


def checked_manifest(data: bytes, source: InitFromSource, where: str) -> Manifest:
    """The manifest ``data`` holds, once its sha256 is the one the coordinator recorded."""
    run = f"run {source.run_id}"
    found = hashlib.sha256(data).hexdigest()
    if found != source.manifest_sha256:
        raise PrepareRefused(
            f"The output manifest of {run} ({where}) was changed after the run ended: "
            f"its sha256 is {found}, the coordinator recorded {source.manifest_sha256}."
        )
    try:
        return read_manifest(data, where)
    except ManifestProblem as exc:
        raise PrepareRefused(str(exc)) from None


def is_local(source: InitFromSource, out_root: Path, node_id: str) -> bool:
    """Whether this Node reads the source itself: a shared output root (no holder named), or
    this Node holds it inside its own output root."""
    if not source.node_id:
        return True
    src = Path(source.out_dir)
    return source.node_id == node_id and src.is_absolute() and _inside(src, out_root)


def materialise_init_from(
    source: InitFromSource,
    out_root: Path,
    dest: Path,
    node_id: str = "",
    fetch: InitFromFetch | None = None,
) -> int:
    """Copy (or fetch) and verify ``source`` into ``dest``; return the bytes written.

    ``node_id`` is this Node's id; ``fetch`` what the Prepare carried to fetch from the holder.
    Raises :class:`PrepareRefused` with a sentence naming the run and the file at fault.
    """
    if is_local(source, out_root, node_id):
        return _materialise_local(source, out_root, dest)
    return _materialise_fetched(source, dest, fetch)


def _materialise_local(source: InitFromSource, out_root: Path, dest: Path) -> int:
    run = f"run {source.run_id}"
    src = Path(source.out_dir)
    if not src.is_absolute() or not _inside(src, out_root) or src == out_root:
        raise PrepareRefused(
            f"The outputs of {run} ({src}) are not inside this Node's output root {out_root}, "
            "so this Node cannot read them; its out_root must be the Fleet's shared_output_root."
        )
    manifest_file = Path(manifest_path(source.out_dir))
    try:
        data = read_manifest_file(manifest_file)
    except FileNotFoundError:
        raise PrepareRefused(
            f"The output manifest of {run} ({manifest_file}) is missing on this Node; is the "
            f"shared output root mounted at {out_root}?"
        ) from None
    except (OSError, ManifestProblem) as exc:
        raise PrepareRefused(
            f"The output manifest of {run} ({manifest_file}) cannot be read: {exc}"
        ) from None
    manifest = checked_manifest(data, source, str(manifest_file))

    @contextmanager
    def open_entry(entry: Entry) -> Iterator[Readable]:
        try:
            f = open_source_file(src, entry.path, run)
        except SourceUnreadable as exc:
            raise PrepareRefused(str(exc)) from None
        with f:
            yield f

    return write_verified(manifest, open_entry, dest, run)


def _materialise_fetched(source: InitFromSource, dest: Path, fetch: InitFromFetch | None) -> int:
    run = f"run {source.run_id}"
    holder = f"Node {source.node_id}"
    if fetch is None or not fetch.address:
        raise PrepareRefused(
            f"The outputs of {run} are on {holder}, and the coordinator sent no way to fetch "
            f"them: {holder} serves no outputs or has not said where (its node.toml [outputs] "
            "listen, its connection to the coordinator). Start it with the listener on, then "
            "submit again."
        )
    where = f"{holder} at {fetch.address}"
    try:
        with outputs_fetch.connect(fetch, source) as conn:
            data = conn.manifest()
            manifest = checked_manifest(data, source, f"the manifest {where} served")
            return write_verified(manifest, conn.open_file, dest, run)
    except outputs_fetch.FetchFailed as exc:
        raise PrepareRefused(f"Fetching the outputs of {run} from {where} failed: {exc}") from None
    except PrepareRefused as exc:
        raise PrepareRefused(f"{exc} (They were fetched from {where}.)") from None


def write_verified(
    manifest: Manifest,
    open_entry: Callable[[Entry], AbstractContextManager[Readable]],
    dest: Path,
    run: str,
) -> int:
    """Write every file the manifest lists, as ``open_entry`` reads it, checked, into
    ``<dest>.partial``; then rename it to ``dest``. Nothing is left under ``.partial`` on a
    refusal; a crash leaves it for the next try to remove."""
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True, mode=0o700)
    copied = 0
    try:
        for entry in manifest.files:
            with open_entry(entry) as reader:
                copied += copy_checked(reader, entry, partial, run)
            crashpoint("during-init-from-copy")
        fsync_dir(partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    shutil.rmtree(dest, ignore_errors=True)
    os.rename(partial, dest)
    fsync_dir(dest.parent)
    return copied


def copy_checked(reader: Readable, entry: Entry, partial: Path, run: str) -> int:
    """Write what ``reader`` gives to ``partial/<entry.path>`` hashing it; refuse unless its
    size and sha256 are the manifest's. The one place either check is made."""
    rel, size, sha256 = entry.path, entry.size, entry.sha256
    target = partial / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    copied = 0
    with open(target, "wb") as out:
        while chunk := reader.read(CHUNK_BYTES):
            copied += len(chunk)
            if copied > size:
                break
            digest.update(chunk)
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    if copied != size or digest.hexdigest() != sha256:
        what = (
            f"{'more' if copied > size else copied} bytes where the manifest lists {size}"
            if copied != size
            else f"sha256 {digest.hexdigest()} where the manifest lists {sha256}"
        )
        raise PrepareRefused(
            f"The file {rel} of {run}'s outputs does not match its manifest ({what}): it was "
            "changed after the run ended, so this run cannot begin from it."
        )
    return copied
