"""One OCI image layer applied to a root filesystem: whiteouts, links and modes as the OCI image
spec says, and nothing ever written outside the root.

Rules:
- A layer is a tar stream, gzip-compressed or not (``application/vnd.oci.image.layer.v1.tar``,
  ``…tar+gzip`` and Docker's names for the same); any other media type is refused with a sentence.
- Entry names are relative to the root: a leading ``/`` or ``./`` is dropped. A name with a ``..``
  component, a NUL or nothing left refuses the whole layer (:class:`LayerRefused` names the entry).
  The caller unpacks into a directory of its own and throws it away on a refusal.
- Nothing is written through a symbolic link. Every parent of an entry is opened one component at
  a time from the root's own descriptor with ``O_NOFOLLOW | O_DIRECTORY``, so a link planted by
  this layer or an earlier one (``etc -> /etc``, ``a -> ../..``) cannot move a write out of the
  root: a parent that is a link or not a directory refuses the layer.
- Symbolic links are written as the image has them, absolute targets too: they are resolved inside
  the container when the member runs, never by the Node. A hard link names a regular file already
  in the root (from this layer or an earlier one), found by the same walk.
- Whiteouts (the spec's "Whiteouts" section) apply to the lower layers only, so a first pass over
  the layer applies them and a second writes its entries: ``.wh.NAME`` removes NAME, and
  ``.wh..wh..opq`` empties its directory of what the lower layers put there.
- Character and block devices are skipped and counted: the member's ``/dev`` comes from the
  sandbox, never from an image. Setuid and setgid bits are dropped (members run with no new
  privileges anyway); the other permission bits, the modification times and, when the Node runs as
  root, the owners are kept. A directory's mode is set after its contents are written.
"""

from __future__ import annotations

import errno
import gzip
import os
import shutil
import stat
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import attrs

#: Layer media types applied as plain tar streams, and those gzip-compressed.
TAR_TYPES = frozenset(
    {
        "application/vnd.oci.image.layer.v1.tar",
        "application/vnd.docker.image.rootfs.diff.tar",
    }
)
GZIP_TYPES = frozenset(
    {
        "application/vnd.oci.image.layer.v1.tar+gzip",
        "application/vnd.docker.image.rootfs.diff.tar.gzip",
    }
)
WHITEOUT_PREFIX = ".wh."
OPAQUE_WHITEOUT = ".wh..wh..opq"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_KEPT_MODE_BITS = 0o1777  # permissions and the sticky bit; never setuid or setgid


class LayerRefused(Exception):
    """The layer cannot be applied safely; ``str()`` says which entry and why."""


@attrs.frozen
class LayerApplied:
    """What one layer put into the root."""

    files: int = 0
    directories: int = 0
    symlinks: int = 0
    hardlinks: int = 0
    whiteouts: int = 0
    devices_skipped: int = 0
    bytes: int = 0


def apply_layer(blob: Path, media_type: str, root: Path) -> LayerApplied:
    """Apply the layer in ``blob`` (of ``media_type``) to the root filesystem at ``root``."""
    if media_type not in TAR_TYPES | GZIP_TYPES:
        raise LayerRefused(
            f"The layer {blob.name} has media type {media_type!r}; TunePlane unpacks "
            f"{', '.join(sorted(TAR_TYPES | GZIP_TYPES))}. Rebuild the image with gzip layers."
        )
    root_fd = os.open(root, _DIR_FLAGS)
    try:
        whiteouts = 0
        with _members(blob, media_type) as entries:
            for _, entry, parts in entries:
                whiteouts += _whiteout(root_fd, entry, parts)
        writer = _Writer(root_fd, whiteouts=whiteouts)
        with _members(blob, media_type) as entries:
            for tar, entry, parts in entries:
                writer.write(tar, entry, parts)
        writer.finish()
        return writer.applied()
    except (tarfile.TarError, EOFError, gzip.BadGzipFile) as exc:
        raise LayerRefused(f"The layer {blob.name} is not a readable tar stream: {exc}") from None
    finally:
        os.close(root_fd)


_Entries = Iterator[tuple[tarfile.TarFile, tarfile.TarInfo, tuple[str, ...]]]


@contextmanager
def _members(blob: Path, media_type: str) -> Iterator[_Entries]:
    """The layer's entries in order, each with its stream and its path components."""
    with blob.open("rb") as file:
        raw: IO[bytes] | gzip.GzipFile = (
            gzip.GzipFile(fileobj=file) if media_type in GZIP_TYPES else file
        )
        with raw, tarfile.open(fileobj=raw, mode="r|") as tar:

            def entries() -> _Entries:
                for entry in tar:
                    parts = _parts(entry.name, f"The layer {blob.name}")
                    if parts:
                        yield tar, entry, parts

            yield entries()


def _parts(name: str, where: str) -> tuple[str, ...]:
    """The path components of ``name`` under the root; () for the root itself."""
    if "\0" in name:
        raise LayerRefused(f"{where} has an entry name with a NUL byte: {name!r}.")
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if ".." in parts:
        raise LayerRefused(
            f"{where} names {name!r}, which climbs out of the image's root with '..'; "
            "TunePlane refuses such an image."
        )
    return parts


def _open_dir(root_fd: int, parts: tuple[str, ...], create: bool, entry: str) -> int:
    """A descriptor of the directory ``parts`` below the root, never following a link; missing
    directories are made (0755) when ``create``, else FileNotFoundError. Raises LayerRefused
    for a component that is a link or not a directory."""
    fd = os.dup(root_fd)
    try:
        for depth, part in enumerate(parts, 1):
            try:
                next_fd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(part, 0o755, dir_fd=fd)
                next_fd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                raise LayerRefused(
                    f"The image entry {entry!r} lies under {'/'.join(parts[:depth])!r}, which "
                    "is a symbolic link or not a directory; TunePlane never writes through a link."
                ) from None
            os.close(fd)
            fd = next_fd
    except BaseException:
        os.close(fd)
        raise
    return fd


def _remove(parent_fd: int, name: str) -> None:
    """Remove ``name`` in the directory, a whole tree when it is a directory (no link followed)."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=parent_fd)
    else:
        os.unlink(name, dir_fd=parent_fd)


def _whiteout(root_fd: int, entry: tarfile.TarInfo, parts: tuple[str, ...]) -> int:
    """First pass: apply the entry when it is a whiteout; 1 if it was one."""
    leaf = parts[-1]
    if not leaf.startswith(WHITEOUT_PREFIX):
        return 0
    try:
        parent = _open_dir(root_fd, parts[:-1], create=False, entry=entry.name)
    except FileNotFoundError:
        return 1  # nothing below to hide
    try:
        if leaf == OPAQUE_WHITEOUT:
            for name in os.listdir(parent):
                _remove(parent, name)
        else:
            _remove(parent, leaf[len(WHITEOUT_PREFIX) :])
    finally:
        os.close(parent)
    return 1


@attrs.define
class _Writer:
    root_fd: int
    whiteouts: int = 0
    counts: dict[str, int] = attrs.field(factory=dict)
    # Directories whose mode and times are set last: (path components, mode, mtime).
    directories: list[tuple[tuple[str, ...], int, float]] = attrs.field(factory=list)
    as_root: bool = attrs.field(factory=lambda: os.geteuid() == 0)

    def count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

    def write(self, tar: tarfile.TarFile, entry: tarfile.TarInfo, parts: tuple[str, ...]) -> None:
        leaf = parts[-1]
        if leaf.startswith(WHITEOUT_PREFIX):
            return
        if entry.ischr() or entry.isblk():
            self.count("devices_skipped")
            return
        parent = _open_dir(self.root_fd, parts[:-1], create=True, entry=entry.name)
        try:
            if entry.isdir():
                self._directory(parent, leaf, entry, parts)
                return
            _remove(parent, leaf)
            if entry.isfile():
                self._file(parent, leaf, tar, entry)
            elif entry.issym():
                os.symlink(entry.linkname, leaf, dir_fd=parent)
                self.count("symlinks")
            elif entry.islnk():
                self._hardlink(parent, leaf, entry)
            elif entry.isfifo():
                os.mkfifo(leaf, entry.mode & _KEPT_MODE_BITS, dir_fd=parent)
            else:
                raise LayerRefused(
                    f"The image entry {entry.name!r} is of a kind TunePlane does not unpack "
                    f"(tar type {entry.type!r})."
                )
            if self.as_root:
                os.chown(leaf, entry.uid, entry.gid, dir_fd=parent, follow_symlinks=False)
            if not entry.issym():
                os.utime(leaf, (entry.mtime, entry.mtime), dir_fd=parent, follow_symlinks=False)
        finally:
            os.close(parent)

    def _directory(
        self, parent: int, leaf: str, entry: tarfile.TarInfo, parts: tuple[str, ...]
    ) -> None:
        try:
            st = os.stat(leaf, dir_fd=parent, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                os.unlink(leaf, dir_fd=parent)
                os.mkdir(leaf, 0o700, dir_fd=parent)
        except FileNotFoundError:
            os.mkdir(leaf, 0o700, dir_fd=parent)
        if self.as_root:
            os.chown(leaf, entry.uid, entry.gid, dir_fd=parent, follow_symlinks=False)
        self.directories.append((parts, entry.mode & _KEPT_MODE_BITS, entry.mtime))
        self.count("directories")

    def _file(self, parent: int, leaf: str, tar: tarfile.TarFile, entry: tarfile.TarInfo) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(leaf, flags, 0o600, dir_fd=parent)
        with os.fdopen(fd, "wb") as out:
            source = tar.extractfile(entry)
            assert source is not None  # a regular file's entry
            shutil.copyfileobj(source, out, 1 << 20)
            os.fchmod(out.fileno(), entry.mode & _KEPT_MODE_BITS)
        self.count("files")
        self.count("bytes", entry.size)

    def _hardlink(self, parent: int, leaf: str, entry: tarfile.TarInfo) -> None:
        target = _parts(entry.linkname, f"The hard link {entry.name!r}")
        if not target:
            raise LayerRefused(f"The image entry {entry.name!r} is a hard link to the root.")
        missing = LayerRefused(
            f"The image entry {entry.name!r} is a hard link to {entry.linkname!r}, which is not "
            "in the image."
        )
        try:
            target_parent = _open_dir(self.root_fd, target[:-1], create=False, entry=entry.name)
        except FileNotFoundError:
            raise missing from None
        try:
            st = os.stat(target[-1], dir_fd=target_parent, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                raise LayerRefused(
                    f"The image entry {entry.name!r} is a hard link to {entry.linkname!r}, "
                    "which is not a regular file in the image."
                )
            os.link(target[-1], leaf, src_dir_fd=target_parent, dst_dir_fd=parent,
                    follow_symlinks=False)  # fmt: skip
        except FileNotFoundError:
            raise missing from None
        finally:
            os.close(target_parent)
        self.count("hardlinks")

    def finish(self) -> None:
        """Directory modes and times last, deepest first, so a read-only one was writable."""
        for parts, mode, mtime in sorted(self.directories, key=lambda d: -len(d[0])):
            try:
                fd = _open_dir(self.root_fd, parts, create=False, entry="/".join(parts))
            except (FileNotFoundError, LayerRefused):
                continue  # a later entry of the layer replaced it (or a folder above it)
            try:
                os.fchmod(fd, mode)
                os.utime(fd, (mtime, mtime))
            finally:
                os.close(fd)

    def applied(self) -> LayerApplied:
        return LayerApplied(whiteouts=self.whiteouts, **self.counts)
