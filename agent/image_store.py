"""The image cache's contents on disk, and their removal: what ``tuneplane-node images``, the size
limit's eviction and ``doctor`` read and remove (the layout is agent/image_cache.py's).

Rules:
- Nothing outside the cache directory is ever removed. Every removal names an entry this module
  recognised (64 lowercase hex, or ``.build-<hex>-…``) directly in one of the cache's own
  folders, and checks, with links resolved, that the folder is that folder of the cache; an
  entry that is a link is unlinked, never followed (:func:`remove_entry`).
- A pull holds the cache's lock (``locks/cache.lock``) shared for as long as it writes; removing
  takes it exclusively, so it never runs beside a pull. Each image and blob is removed while its
  own per-digest lock (the one the pull takes) is held, taken without waiting: a busy one is
  skipped and said so.
- An image a live member uses is never removed, and no image is removed while a live member's
  runtime is unknown (agent/image_usage.py). Blobs are removed only when no remaining image
  refers to them.
- Deciding is pure (:func:`plan_prune`, :func:`plan_eviction`); carrying out is
  :func:`carry_out`. "Size" is bytes on disk (allocated blocks), links counted once per root.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
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
from .image_usage import ImageUsage
from .sizes import human_bytes

GC_LOCK = "cache.lock"
#: The cache's folder in the Node's state directory.
IMAGE_ROOT_NAME = "tuneplane-images"
_HEX = re.compile(r"[0-9a-f]{64}")
_BUILD = re.compile(r"\.build-([0-9a-f]{64})-.+")
_RECORD = re.compile(r"[0-9a-f]{64}\.json")
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
        return frozenset(h for h in found if _HEX.fullmatch(h))
    if not isinstance(document, Index):
        found.update(d.digest_hex for d in document.blobs)
    return frozenset(h for h in found if _HEX.fullmatch(h))


def scan(directory: Path) -> CacheContents:
    """Read what the cache holds (measures a root the first time it is seen)."""
    images: list[CachedImage] = []
    recorded: set[str] = set()
    for entry in _entries(directory / "images"):
        name, _, ext = entry.name.partition(".")
        if ext != "json" or not _HEX.fullmatch(name) or not entry.is_file(follow_symlinks=False):
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
        if _HEX.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
            blobs[entry.name] = disk_bytes(entry.stat(follow_symlinks=False))
    orphans: dict[str, int] = {}
    builds: dict[str, int] = {}
    for entry in _entries(directory / "roots"):
        if entry.is_symlink():
            continue
        if _HEX.fullmatch(entry.name) and entry.name not in recorded:
            orphans[entry.name] = tree_bytes(Path(entry.path))
        elif _BUILD.fullmatch(entry.name):
            builds[entry.name] = tree_bytes(Path(entry.path))
    partials: dict[str, tuple[int, float]] = {}
    for entry in _entries(directory / "partial"):
        if _HEX.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
            st = entry.stat(follow_symlinks=False)
            partials[entry.name] = (disk_bytes(st), st.st_mtime)
    busy = frozenset(
        name
        for entry in _entries(directory / "locks")
        if (name := entry.name.removesuffix(".lock")) and _HEX.fullmatch(name)
        if is_busy(directory, name)
    )
    images.sort(key=lambda i: (-i.used_at_ms, i.ref))
    return CacheContents(directory, tuple(images), blobs, orphans, builds, partials, busy)


# -- deciding (pure) ------------------------------------------------------------------------


@attrs.frozen
class Removal:
    """What to remove: images (record, root, marks), orphan roots, build folders, partial
    downloads and blobs; ``bytes`` they hold on disk; ``kept`` sentences for what stays."""

    images: tuple[str, ...] = ()
    orphan_roots: tuple[str, ...] = ()
    builds: tuple[str, ...] = ()
    partials: tuple[str, ...] = ()
    blobs: tuple[str, ...] = ()
    bytes: int = 0
    kept: tuple[str, ...] = ()


def _closure_of_busy(contents: CacheContents, documents: Mapping[str, frozenset[str]]) -> set[str]:
    """Blobs a pull in progress may count on: every busy digest and what its cached manifest or
    index names (``documents``: blob hex -> the hex it names, for the busy ones)."""
    protected = set(contents.busy)
    for hex_ in contents.busy:
        protected |= documents.get(hex_, frozenset())
    return protected


def unreferenced_blobs(
    contents: CacheContents,
    removed_images: frozenset[str],
    busy_documents: Mapping[str, frozenset[str]],
) -> tuple[str, ...]:
    """Blobs no image that stays refers to and no pull in progress may count on."""
    referenced: set[str] = set()
    for image in contents.images:
        if image.digest_hex not in removed_images:
            referenced |= image.blobs
    referenced |= _closure_of_busy(contents, busy_documents)
    return tuple(sorted(h for h in contents.blobs if h not in referenced))


def _freeable(
    contents: CacheContents, usage: ImageUsage, keep: frozenset[str]
) -> tuple[list[CachedImage], list[str]]:
    """Images that may be removed, least recently used first, and sentences for those kept."""
    kept: list[str] = []
    free: list[CachedImage] = []
    for image in sorted(contents.images, key=lambda i: (i.used_at_ms, i.ref)):
        users = usage.users(image.digest_hex)
        if users:
            kept.append(f"{image.ref} is used by member {', '.join(str(k) for k in users)}")
        elif image.digest_hex in contents.busy:
            kept.append(f"{image.ref} is being pulled or used by a pull now")
        elif image.digest_hex in keep:
            kept.append(f"{image.ref} was just made ready for a member")
        else:
            free.append(image)
    return free, kept


def plan_eviction(
    contents: CacheContents,
    usage: ImageUsage,
    max_bytes: int,
    *,
    keep: frozenset[str] = frozenset(),
    busy_documents: Mapping[str, frozenset[str]] | None = None,
    already: Removal | None = None,
) -> Removal:
    """Least recently used images first until the cache holds at most ``max_bytes`` (after
    ``already`` is removed), never one a live member uses, one busy, or one in ``keep``; with a
    live member whose runtime is unknown, none. ``kept`` says why the limit is not met."""
    base = already or Removal()
    documents = busy_documents or {}
    total = contents.total_bytes - base.bytes
    if total <= max_bytes:
        return base
    if usage.unknown:
        return attrs.evolve(base, kept=(*base.kept, usage.unknown_sentence()))
    free, kept = _freeable(contents, usage, keep)
    chosen: list[str] = []
    # Blobs no image refers to go first (prune's, when ``already`` is prune's plan).
    gone_blobs = set(unreferenced_blobs(contents, frozenset(), documents))
    freed = sum(contents.blobs[h] for h in gone_blobs - set(base.blobs))
    gone_blobs |= set(base.blobs)
    for image in free:
        if total - freed <= max_bytes:
            break
        chosen.append(image.digest_hex)
        freed += image.root_bytes
        now_free = set(unreferenced_blobs(contents, frozenset(chosen), documents)) - gone_blobs
        freed += sum(contents.blobs[h] for h in now_free)
        gone_blobs |= now_free
    reasons = list(base.kept)
    if total - freed > max_bytes:
        reasons.append(
            f"the cache holds {human_bytes(total - freed)} after removing all it may, over its "
            f"limit of {human_bytes(max_bytes)}: "
            + ("; ".join(kept) if kept else "nothing else can be removed")
        )
    return attrs.evolve(
        base,
        images=(*base.images, *chosen),
        blobs=tuple(sorted(gone_blobs)),
        bytes=base.bytes + freed,
        kept=tuple(reasons),
    )


def plan_prune(
    contents: CacheContents,
    now: float,
    partial_age_s: float,
    busy_documents: Mapping[str, frozenset[str]] | None = None,
) -> Removal:
    """What no image needs: roots without a record and build folders left behind (their image
    not being pulled), partial downloads untouched for ``partial_age_s`` (not being written),
    and blobs no image refers to."""
    orphans = tuple(sorted(h for h in contents.orphan_roots if h not in contents.busy))
    builds = tuple(
        sorted(
            name
            for name in contents.builds
            if (m := _BUILD.fullmatch(name)) and m[1] not in contents.busy
        )
    )
    partials = tuple(
        sorted(
            h
            for h, (_, mtime) in contents.partials.items()
            if h not in contents.busy and now - mtime >= partial_age_s
        )
    )
    blobs = unreferenced_blobs(contents, frozenset(), busy_documents or {})
    freed = (
        sum(contents.orphan_roots[h] for h in orphans)
        + sum(contents.builds[n] for n in builds)
        + sum(contents.partials[h][0] for h in partials)
        + sum(contents.blobs[h] for h in blobs)
    )
    return Removal((), orphans, builds, partials, blobs, freed)


def plan_removal(contents: CacheContents, usage: ImageUsage, image: CachedImage) -> Removal:
    """``images rm``: the image and the blobs only it refers to; refused (a sentence) while a
    live member uses it, may use it, or a pull holds it."""
    users = usage.users(image.digest_hex)
    if users:
        names = ", ".join(str(k) for k in users)
        raise CacheRefused(
            f"The image {image.ref} is used by live member {names}; it cannot be removed while "
            "a member uses it. Remove it after the member ends (`tuneplane-node journal "
            "members` shows its state)."
        )
    if usage.unknown:
        raise CacheRefused(f"The image {image.ref} was not removed. {usage.unknown_sentence()}")
    if image.digest_hex in contents.busy:
        raise CacheRefused(
            f"The image {image.ref} is being pulled or completed now; run the command again "
            "when that ends."
        )
    blobs = unreferenced_blobs(contents, frozenset({image.digest_hex}), {})
    blobs = tuple(h for h in blobs if h in image.blobs)
    freed = image.root_bytes + sum(contents.blobs[h] for h in blobs)
    return Removal(images=(image.digest_hex,), blobs=blobs, bytes=freed)


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


# -- carrying out ---------------------------------------------------------------------------


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
    if not (_HEX.fullmatch(name) or _BUILD.fullmatch(name) or _RECORD.fullmatch(name)):
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
        m = _BUILD.fullmatch(name)
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
