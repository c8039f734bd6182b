"""The image cache's contents on disk and its locks: what ``tuneplane-node images``, the size
limit's eviction and ``doctor`` read (the layout is agent/image_cache.py's). Removal is planned
by :mod:`.image_removal_plan` and carried out by :mod:`.image_removal`, under these rules.

Rules:
- Nothing outside the cache directory is ever removed. Every removal names an entry this module
  recognised (64 lowercase hex, or ``.build-<hex>-…``) directly in one of the cache's own
  folders, and checks, with links resolved, that the folder is that folder of the cache; an
  entry that is a link is unlinked, never followed (:func:`.image_removal.remove_entry`).
- A pull holds the cache's lock (``locks/cache.lock``) shared for as long as it writes; removing
  takes it exclusively, so it never runs beside a pull. Each image and blob is removed while its
  own per-digest lock (the one the pull takes) is held, taken without waiting: a busy one is
  skipped and said so.
- An image a live member uses is never removed, and no image is removed while a live member's
  runtime is unknown (agent/image_usage.py). Blobs are removed only when no remaining image
  refers to them.
- Deciding is pure (:func:`.image_removal_plan.plan_prune`, ``plan_eviction``); carrying out
  is :func:`.image_removal.carry_out`. "Size" is bytes on disk (allocated blocks), links
  counted once per root.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import attrs

from .atomic_file import write_json_atomic
from .image_errors import ImageError
from .image_manifest import Index, read_document

GC_LOCK = "cache.lock"
#: The cache's folder in the Node's state directory.
IMAGE_ROOT_NAME = "tuneplane-images"
HEX_NAME = re.compile(r"[0-9a-f]{64}")
BUILD_NAME = re.compile(r"\.build-([0-9a-f]{64})-.+")
RECORD_NAME = re.compile(r"[0-9a-f]{64}\.json")
#: Partial downloads untouched for this long are stale: a pull that stopped and never resumed.
DEFAULT_PARTIAL_AGE_S = 24 * 3600


class CacheRefused(Exception):
    """A cache command that must not be carried out; ``str()`` says why and what to do."""


def default_image_root(state_dir: Path) -> Path:
    """Where runtime images are cached when none is set: beside the state dir (a member's
    sandbox, running as the member's account, must reach its image's root; the state dir is
    0700)."""
    return state_dir.parent / IMAGE_ROOT_NAME


def cache_directory(state_dir: Path, image_root: Path | None = None) -> Path:
    """Where the Node keeps its image cache: ``image_root`` (node.toml, ``--image-root``) or, by
    default, ``tuneplane-images`` beside the state dir, as ``tuneplane-node run`` uses it."""
    return image_root if image_root is not None else default_image_root(state_dir)


# -- locks ----------------------------------------------------------------------------------


def lock_path(directory: Path, digest_hex: str) -> Path:
    """The per-digest lock file the cache's pulls take (agent/image_cache.py)."""
    return directory / "locks" / f"{digest_hex}.lock"


def gc_lock_path(directory: Path) -> Path:
    """The cache's lock: shared by every pull while it writes, exclusive while removing."""
    return directory / "locks" / GC_LOCK


def try_lock(path: Path, *, shared: bool = False) -> int | None:
    """An open fd holding flock(2) on ``path`` (made if missing), or None when another holds it
    (closing the fd releases the lock)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def is_busy(directory: Path, digest_hex: str) -> bool:
    """Whether some process holds the per-digest lock of ``digest_hex`` now (a pull of that
    image, or a download of that blob)."""
    path = lock_path(directory, digest_hex)
    if not path.exists():
        return False
    fd = try_lock(path)
    if fd is None:
        return True
    os.close(fd)
    return False


@contextmanager
def removing(
    directory: Path, on_wait: Callable[[], None] | None = None, poll_s: float = 0.1
) -> Iterator[bool]:
    """Hold the cache's lock exclusively (no pull writes meanwhile). With ``on_wait`` it waits,
    calling it once when it first has to, and yields True; without, it does not wait and yields
    whether it got the lock."""
    path = gc_lock_path(directory)
    told = False
    while True:
        fd = try_lock(path)
        if fd is not None or on_wait is None:
            break
        if not told:
            on_wait()
            told = True
        time.sleep(poll_s)
    try:
        yield fd is not None
    finally:
        if fd is not None:
            os.close(fd)


# -- what is there --------------------------------------------------------------------------


@attrs.frozen
class CachedImage:
    """One image with a record: its key (the pinned digest's hex), what it refers to, its size."""

    digest_hex: str
    ref: str
    manifest: str  # sha256:…
    layers: int
    blobs: frozenset[str]  # the hex of every blob it refers to that the cache may hold
    root_bytes: int  # 0 when the root is missing
    root_present: bool
    used_at_ms: int


@attrs.frozen
class CacheContents:
    """Everything under one cache directory, as :func:`scan` found it."""

    directory: Path
    images: tuple[CachedImage, ...]
    blobs: Mapping[str, int]  # hex -> bytes on disk
    orphan_roots: Mapping[str, int]  # roots/<hex> without a record -> bytes
    builds: Mapping[str, int]  # roots/.build-* name -> bytes
    partials: Mapping[str, tuple[int, float]]  # hex -> (bytes, mtime)
    busy: frozenset[str]  # hex whose per-digest lock some process holds

    @property
    def total_bytes(self) -> int:
        return (
            sum(self.blobs.values())
            + sum(i.root_bytes for i in self.images)
            + sum(self.orphan_roots.values())
            + sum(self.builds.values())
            + sum(b for b, _ in self.partials.values())
        )

    def image_bytes(self, image: CachedImage) -> int:
        """Its root and every blob it refers to (a blob shared with another image counts in
        both)."""
        return image.root_bytes + sum(self.blobs.get(h, 0) for h in image.blobs)

    def find(self, text: str) -> CachedImage:
        """The image ``text`` names: its reference (``image:`` optional), its pinned or manifest
        digest (``sha256:<hex>``), or a prefix of at least 12 hex digits of either."""
        wanted = text.strip().removeprefix("image:")
        hexpart = wanted.removeprefix("sha256:")
        matches = [
            i
            for i in self.images
            if i.ref.removeprefix("image:") == wanted
            or (
                len(hexpart) >= 12
                and _is_hex(hexpart)
                and (
                    i.digest_hex.startswith(hexpart)
                    or i.manifest.removeprefix("sha256:").startswith(hexpart)
                )
            )
        ]
        if not matches:
            raise CacheRefused(
                f"No cached image is {text!r}; `tuneplane-node images ls` lists them (give a "
                "reference, a digest, or at least 12 of its hex digits)."
            )
        if len(matches) > 1:
            raise CacheRefused(
                f"{text!r} names {len(matches)} cached images ("
                + ", ".join(m.ref for m in matches)
                + "); give more of the digest."
            )
        return matches[0]


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def disk_bytes(st: os.stat_result) -> int:
    return int(st.st_blocks) * 512


def tree_bytes(root: Path) -> int:
    """Bytes on disk under ``root`` (links not followed; a hard-linked file counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for folder, dirs, files in os.walk(root, followlinks=False):
        for name in (*dirs, *files):
            try:
                st = os.lstat(os.path.join(folder, name))
            except FileNotFoundError:
                continue
            if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                if (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
            total += disk_bytes(st)
    with suppress(FileNotFoundError):
        total += disk_bytes(os.lstat(root))
    return total


def _entries(folder: Path) -> list[os.DirEntry[str]]:
    try:
        return list(os.scandir(folder))
    except FileNotFoundError:
        return []


def used_path(directory: Path, digest_hex: str) -> Path:
    return directory / "used" / digest_hex


def mark_used(directory: Path, digest_hex: str, at_ms: int | None = None) -> None:
    """Record durably (atomic file) that the image ``digest_hex`` was used now: what the size
    limit's least-recently-used order reads."""
    path = used_path(directory, digest_hex)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"used_at_ms": at_ms if at_ms is not None else _now_ms()})


def _now_ms() -> int:
    return int(time.time() * 1000)


def _used_at(directory: Path, digest_hex: str, record_mtime: float) -> int:
    try:
        return int(json.loads(used_path(directory, digest_hex).read_bytes())["used_at_ms"])
    except (OSError, ValueError, KeyError, TypeError):
        return int(record_mtime * 1000)  # never marked: when it became ready


def sizes_path(directory: Path, digest_hex: str) -> Path:
    return directory / "sizes" / digest_hex


def keep_root_bytes(directory: Path, digest_hex: str) -> int:
    """Measure the image's root and keep its size in ``sizes/<hex>`` (a root never changes):
    the cache does it once, when the root is put in place, so reading the cache writes
    nothing."""
    measured = tree_bytes(directory / "roots" / digest_hex)
    path = sizes_path(directory, digest_hex)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"root_bytes": measured})
    return measured


def _root_bytes(directory: Path, digest_hex: str) -> int:
    """The root's kept size, or measured now (a root a cache before sizes/ unpacked)."""
    try:
        return int(json.loads(sizes_path(directory, digest_hex).read_bytes())["root_bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        return tree_bytes(directory / "roots" / digest_hex)


def _blobs_of(directory: Path, digest_hex: str, record: Mapping[str, Any]) -> frozenset[str]:
    """The pinned document, the platform manifest, its config and layers. The config's digest
    is only in the manifest: read from the cache (verified); without it, the rest."""
    manifest_hex = str(record.get("manifest", "")).removeprefix("sha256:")
    found = {digest_hex, manifest_hex}
    found.update(str(d["digest"]).removeprefix("sha256:") for d in record.get("layers", []))
    try:
        data = (directory / "blobs" / "sha256" / manifest_hex).read_bytes()
        document = read_document(data, "", manifest_hex, record.get("ref", digest_hex))
    except (OSError, ImageError):
        return frozenset(h for h in found if HEX_NAME.fullmatch(h))
    if not isinstance(document, Index):
        found.update(d.digest_hex for d in document.blobs)
    return frozenset(h for h in found if HEX_NAME.fullmatch(h))


def scan(directory: Path) -> CacheContents:
    """Read what the cache holds (measures a root the first time it is seen)."""
    images: list[CachedImage] = []
    recorded: set[str] = set()
    for entry in _entries(directory / "images"):
        name, _, ext = entry.name.partition(".")
        if (
            ext != "json"
            or not HEX_NAME.fullmatch(name)
            or not entry.is_file(follow_symlinks=False)
        ):
            continue
        try:
            record = json.loads(Path(entry.path).read_bytes())
            mtime = entry.stat(follow_symlinks=False).st_mtime
        except (OSError, ValueError):
            continue
        if not isinstance(record, dict):
            continue
        recorded.add(name)
        root = directory / "roots" / name
        present = root.is_dir() and not root.is_symlink()
        images.append(
            CachedImage(
                digest_hex=name,
                ref=str(record.get("ref", f"sha256:{name}")),
                manifest=str(record.get("manifest", "")),
                layers=len(record.get("layers", [])),
                blobs=_blobs_of(directory, name, record),
                root_bytes=_root_bytes(directory, name) if present else 0,
                root_present=present,
                used_at_ms=_used_at(directory, name, mtime),
            )
        )
    blobs: dict[str, int] = {}
    for entry in _entries(directory / "blobs" / "sha256"):
        if HEX_NAME.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
            blobs[entry.name] = disk_bytes(entry.stat(follow_symlinks=False))
    orphans: dict[str, int] = {}
    builds: dict[str, int] = {}
    for entry in _entries(directory / "roots"):
        if entry.is_symlink():
            continue
        if HEX_NAME.fullmatch(entry.name) and entry.name not in recorded:
            orphans[entry.name] = tree_bytes(Path(entry.path))
        elif BUILD_NAME.fullmatch(entry.name):
            builds[entry.name] = tree_bytes(Path(entry.path))
    partials: dict[str, tuple[int, float]] = {}
    for entry in _entries(directory / "partial"):
        if HEX_NAME.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
            st = entry.stat(follow_symlinks=False)
            partials[entry.name] = (disk_bytes(st), st.st_mtime)
    busy = frozenset(
        name
        for entry in _entries(directory / "locks")
        if (name := entry.name.removesuffix(".lock")) and HEX_NAME.fullmatch(name)
        if is_busy(directory, name)
    )
    images.sort(key=lambda i: (-i.used_at_ms, i.ref))
    return CacheContents(directory, tuple(images), blobs, orphans, builds, partials, busy)


# -- deciding (pure) ------------------------------------------------------------------------
