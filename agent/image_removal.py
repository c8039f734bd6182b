"""Carrying out the image cache's removals (planned by :mod:`.image_removal_plan`): what
``tuneplane-node images rm|prune`` and the size limit's eviction remove on disk.

Rules (the cache's, in :mod:`.image_store`): nothing outside the cache directory is ever removed;
an entry is removed only under its per-digest lock, taken without waiting (a busy one is
skipped and said so), and only while :func:`.image_store.removing` is held; a link is unlinked,
never followed.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path
from typing import Any

import attrs

from .image_errors import ImageError
from .image_manifest import Index, read_document
from .image_removal_plan import Removal, plan_eviction
from .image_store import (
    BUILD_NAME,
    HEX_NAME,
    RECORD_NAME,
    CacheContents,
    disk_bytes,
    lock_path,
    removing,
    scan,
    tree_bytes,
    try_lock,
)
from .image_usage import ImageUsage


def busy_documents(contents: CacheContents) -> dict[str, frozenset[str]]:
    """For each busy digest whose manifest or index is cached: the blobs it names (a pull in
    progress has written its manifest before its layers)."""
    found: dict[str, frozenset[str]] = {}
    blobs_dir = contents.directory / "blobs" / "sha256"
    for hex_ in contents.busy:
        try:
            document = read_document((blobs_dir / hex_).read_bytes(), "", hex_, hex_)
        except (OSError, ImageError):
            continue
        if isinstance(document, Index):
            names = {d.digest_hex for d in document.manifests}
            for child in list(names):
                try:
                    inner = read_document((blobs_dir / child).read_bytes(), "", child, child)
                except (OSError, ImageError):
                    continue
                if not isinstance(inner, Index):
                    names |= {d.digest_hex for d in inner.blobs}
            found[hex_] = frozenset(names)
        else:
            found[hex_] = frozenset(d.digest_hex for d in document.blobs)
    return found


@attrs.frozen
class Removed:
    """What :func:`carry_out` removed and the bytes freed, and what it skipped (sentences)."""

    images: tuple[str, ...]
    orphan_roots: tuple[str, ...]
    builds: tuple[str, ...]
    partials: tuple[str, ...]
    blobs: tuple[str, ...]
    bytes: int
    skipped: tuple[str, ...]


class OutsideCache(Exception):
    """A path to remove is not where the cache keeps its entries (a bug or a planted link)."""


def _folder(directory: Path, *parts: str) -> Path:
    """The cache's folder ``parts``, resolved; it must lie inside the resolved cache."""
    cache = directory.resolve(strict=True)
    if cache == Path(cache.anchor):
        raise OutsideCache(f"The image cache {directory} resolves to {cache}; refusing to remove.")
    folder = cache.joinpath(*parts)
    real = Path(os.path.realpath(folder))
    if real != folder:
        raise OutsideCache(
            f"{directory.joinpath(*parts)} leads to {real}, outside the image cache; nothing "
            "was removed there. Remove the link by hand."
        )
    return folder


def remove_entry(directory: Path, folder_parts: tuple[str, ...], name: str) -> int:
    """Remove ``<cache>/<folder_parts>/<name>`` (a file, a link, or a whole tree, links never
    followed) and return the bytes it held; 0 when it was already gone. ``name`` must be one
    this module recognises; the folder must resolve inside the cache."""
    if not (HEX_NAME.fullmatch(name) or BUILD_NAME.fullmatch(name) or RECORD_NAME.fullmatch(name)):
        raise OutsideCache(f"{name!r} is not the name of an image cache entry; nothing removed.")
    folder = _folder(directory, *folder_parts)
    path = folder / name
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0
    if stat.S_ISDIR(st.st_mode):
        held = tree_bytes(path)
        remove_tree(path)
        return held
    path.unlink()
    return disk_bytes(st)


def carry_out(directory: Path, plan: Removal) -> Removed:
    """Remove what ``plan`` names, each under its per-digest lock taken without waiting (a
    busy one is skipped). The caller holds :func:`removing`. An image goes record first, so it
    is no longer ready before its root goes."""
    skipped: list[str] = []
    done_images: list[str] = []
    done: dict[str, list[str]] = {"orphans": [], "builds": [], "partials": [], "blobs": []}
    freed = 0

    def locked(hex_: str, what: str) -> int | None:
        fd = try_lock(lock_path(directory, hex_))
        if fd is None:
            skipped.append(f"{what} was skipped: a pull holds it now")
        return fd

    for hex_ in plan.images:
        fd = locked(hex_, f"image sha256:{hex_}")
        if fd is None:
            continue
        try:
            freed += remove_entry(directory, ("images",), f"{hex_}.json")
            freed += remove_entry(directory, ("roots",), hex_)
            remove_entry(directory, ("used",), hex_)
            remove_entry(directory, ("sizes",), hex_)
        finally:
            os.close(fd)
        done_images.append(hex_)
    for key, parts, names in (
        ("orphans", ("roots",), plan.orphan_roots),
        ("partials", ("partial",), plan.partials),
        ("blobs", ("blobs", "sha256"), plan.blobs),
    ):
        for hex_ in names:
            fd = locked(hex_, f"{'/'.join(parts)}/{hex_}")
            if fd is None:
                continue
            try:
                freed += remove_entry(directory, parts, hex_)
                if key == "orphans":
                    remove_entry(directory, ("sizes",), hex_)
            finally:
                os.close(fd)
            done[key].append(hex_)
    for name in plan.builds:
        m = BUILD_NAME.fullmatch(name)
        assert m is not None, "plan_prune names build folders it matched"
        fd = locked(m[1], f"roots/{name}")
        if fd is None:
            continue
        try:
            freed += remove_entry(directory, ("roots",), name)
        finally:
            os.close(fd)
        done["builds"].append(name)
    return Removed(
        tuple(done_images),
        tuple(done["orphans"]),
        tuple(done["builds"]),
        tuple(done["partials"]),
        tuple(done["blobs"]),
        freed,
        tuple(skipped),
    )


def remove_tree(path: Path) -> None:
    """Remove ``path`` and everything under it, even directories an image made read-only (no
    link is followed: ``rmtree`` removes links, never their targets)."""

    def writable_and_again(function: Any, failed: str, info: Any) -> None:
        exc = info[1]
        parent = os.path.dirname(failed)
        if isinstance(exc, PermissionError) and parent:
            st = os.lstat(parent)
            if stat.S_ISDIR(st.st_mode):
                os.chmod(parent, st.st_mode | stat.S_IRWXU)
                function(failed)
                return
        if isinstance(exc, FileNotFoundError):
            return
        raise exc

    if path.is_symlink() or not path.exists():
        path.unlink(missing_ok=True)
        return
    os.chmod(path, 0o700)
    shutil.rmtree(path, onerror=writable_and_again)  # onexc is Python 3.12's


@attrs.frozen
class Eviction:
    """What one eviction removed, the bytes the cache is still over its limit by (0: met), and
    why what stays stayed."""

    removed: Removed
    over_by: int
    kept: tuple[str, ...]


def evict(
    directory: Path, max_bytes: int, usage: ImageUsage, keep: frozenset[str] = frozenset()
) -> Eviction | None:
    """Remove least recently used images (and the blobs only they refer to) until the cache
    holds at most ``max_bytes``; None, removing nothing, when a pull or another removal holds
    the cache's lock (the last pull to finish evicts)."""
    with removing(directory) as got:
        if not got:
            return None
        contents = scan(directory)
        plan = plan_eviction(
            contents, usage, max_bytes, keep=keep, busy_documents=busy_documents(contents)
        )
        removed = carry_out(directory, plan)
    after = contents.total_bytes - removed.bytes
    return Eviction(removed, max(0, after - max_bytes), (*plan.kept, *removed.skipped))
