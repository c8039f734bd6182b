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
- Crash-safe: everything is written under ``<dest>.partial`` (removed first if a crash left one),
  each file fsynced, then renamed to ``<dest>`` in one step. Repeating the step redoes it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from tuneplane.agent.crashpoint import crashpoint
from tuneplane.agent.outputs_manifest import (
    CHUNK_BYTES,
    MAX_MANIFEST_BYTES,
    ManifestProblem,
    NotRegular,
    open_regular,
    read_manifest,
)
from tuneplane.agent.prepare import PrepareRefused
from tuneplane.agent.runner_pyz import CAPSULE_DIR
from tuneplane.coordinator.derivation import InitFromSource, manifest_path

#: Where the source's files land, relative to the member's work directory; the workload finds
#: them through ``$TUNEPLANE_INIT_FROM_DIR``.
INIT_FROM_DIR = Path(CAPSULE_DIR).parent / "init-from"
ENV_NAME = "TUNEPLANE_INIT_FROM_DIR"


def _inside(path: Path, root: Path) -> bool:
    real = Path(os.path.realpath(path))
    base = Path(os.path.realpath(root))
    return real == base or base in real.parents


def _read_bounded(path: Path, limit: int) -> bytes:
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ManifestProblem(f"The output manifest {path} is larger than {limit} bytes.")
    return data


def materialise_init_from(source: InitFromSource, out_root: Path, dest: Path) -> int:
    """Copy and verify ``source`` into ``dest``; return the bytes copied.

    Raises :class:`PrepareRefused` with a sentence naming the run and the file at fault.
    """
    run = f"run {source.run_id}"
    src = Path(source.out_dir)
    if not src.is_absolute() or not _inside(src, out_root) or src == out_root:
        raise PrepareRefused(
            f"The outputs of {run} ({src}) are not inside this Node's output root {out_root}, "
            "so this Node cannot read them; its out_root must be the Fleet's shared_output_root."
        )
    manifest_file = Path(manifest_path(source.out_dir))
    try:
        data = _read_bounded(manifest_file, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise PrepareRefused(
            f"The output manifest of {run} ({manifest_file}) is missing on this Node; is the "
            f"shared output root mounted at {out_root}?"
        ) from None
    except (OSError, ManifestProblem) as exc:
        raise PrepareRefused(
            f"The output manifest of {run} ({manifest_file}) cannot be read: {exc}"
        ) from None
    found = hashlib.sha256(data).hexdigest()
    if found != source.manifest_sha256:
        raise PrepareRefused(
            f"The output manifest of {run} ({manifest_file}) was changed after the run ended: "
            f"its sha256 is {found}, the coordinator recorded {source.manifest_sha256}."
        )
    try:
        manifest = read_manifest(data, str(manifest_file))
    except ManifestProblem as exc:
        raise PrepareRefused(str(exc)) from None
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True, mode=0o700)
    copied = 0
    for entry in manifest.files:
        copied += _copy_checked(src, entry.path, entry.size, entry.sha256, partial, run)
        crashpoint("during-init-from-copy")
    _fsync_dir(partial)
    shutil.rmtree(dest, ignore_errors=True)
    os.rename(partial, dest)
    _fsync_dir(dest.parent)
    return copied


def _copy_checked(src: Path, rel: str, size: int, sha256: str, partial: Path, run: str) -> int:
    """Copy ``src/rel`` to ``partial/rel`` hashing it; refuse unless size and sha256 match."""
    origin = src / rel
    if not _inside(origin.parent, src):
        raise PrepareRefused(
            f"The file {rel} of {run}'s outputs lies behind a link out of {src}; refused."
        )
    target = partial / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    copied = 0
    try:
        fd = open_regular(origin)
    except NotRegular:
        raise PrepareRefused(
            f"The file {rel} of {run}'s outputs is not a regular file any more; refused."
        ) from None
    except FileNotFoundError:
        raise PrepareRefused(
            f"The file {rel} of {run}'s outputs is missing from {src}; the manifest lists it."
        ) from None
    except OSError as exc:
        raise PrepareRefused(
            f"The file {rel} of {run}'s outputs cannot be opened ({exc.strerror}); a link or "
            "an unreadable file is refused."
        ) from None
    with os.fdopen(fd, "rb") as f, open(target, "wb") as out:
        while chunk := f.read(CHUNK_BYTES):
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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
