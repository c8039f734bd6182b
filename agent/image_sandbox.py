"""The bubblewrap command a member runs under inside an unpacked OCI image root (pure: no I/O).

Theory of operation. The image root (a plain directory, unpacked by :mod:`.image_layer`) is bound
read-only as ``/``. The sandbox then needs mount points the image may lack (``/proc``, the
member's work directory at its host path, ``/etc/hosts``, the driver library directory), and a
read-only root cannot grow them; the cached image is never written either, since other members
share it. So, as Apptainer's "underlay" does, a directory of the image that lacks a mount point
is replaced by a tmpfs holding the directory's own entries (each bound read-only from the image,
links re-made as links) plus the missing mount points, and that tmpfs is made read-only again
once everything is mounted. :func:`mount_points` says which paths are needed; the agent reads
the image for them (``image_host.probe_image``) and :func:`bwrap_argv` turns both into argv.

Rules:
- Read-only everywhere except the member's work and output directories and its telemetry
  directory, which are bound writable at the same paths as on the host, so every path the recipe,
  the capsule, the runner and the collector already use stays valid. ``/tmp`` and ``/dev/shm``
  are private tmpfs; ``/dev`` is fresh with only the member's own GPU device nodes
  (:func:`tuneplane.agent.sandbox.gpu_devices` chooses them); ``/proc`` is the sandbox's own
  (``--unshare-pid``), IPC is private (``--unshare-ipc``).
- The host's ``/etc/resolv.conf`` and ``/etc/hosts`` are bound read-only over the image's when
  the host has them, so rendezvous by hostname resolves as on the host (the network is shared).
- The host's NVIDIA driver libraries and tools are bound read-only into ``/usr/local/nvidia/lib64``
  and ``/usr/local/nvidia/bin`` (the directories NVIDIA's CUDA images already name in their
  ``LD_LIBRARY_PATH`` and ``PATH``), only when the member has GPUs; :class:`DriverFiles` says
  which, chosen as libnvidia-container chooses them.
- The image's ``User`` is not honoured: members run as the account Node policy chose (the runner
  switches to it before bubblewrap starts), never as a user an image names, because an image is
  the researcher's and the account is the Node's trust boundary (DESIGN.md, "Trust boundaries").
- Signals as in :func:`tuneplane.agent.sandbox.bwrap_argv`: no ``--die-with-parent`` and no
  ``--new-session``; the runner starts bubblewrap with SIGTERM ignored and the sandbox's first
  program restores it, so a stop reaches the workload and bubblewrap waits for it (the grace
  period). An image may have no ``env --default-signal`` (busybox's ``env`` has none), so that
  first program is the host's own GNU ``env``, bound in with its ELF interpreter and libraries
  (:class:`SignalHelper`) and started through that interpreter, never through the image's.
"""

from __future__ import annotations

import posixpath
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Literal

import attrs

from .image_manifest import ImageConfig
from .sandbox import BWRAP

#: Where the host's driver libraries and tools appear in the image (nvidia-docker's directories).
NVIDIA_LIB_DIR = "/usr/local/nvidia/lib64"
NVIDIA_BIN_DIR = "/usr/local/nvidia/bin"
#: Where the host's ``env`` and what it needs to start appear in the image.
HELPER_DIR = "/usr/local/tuneplane"
HELPER_ENV = f"{HELPER_DIR}/env"
HELPER_LOADER = f"{HELPER_DIR}/ld.so"
HELPER_LIB_DIR = f"{HELPER_DIR}/lib"
#: The tmpfs the sandbox mounts for itself: what lies under them is made there, not in the image.
PRIVATE_TMPFS = ("/dev", "/tmp")
#: Host files bound read-only over the image's when the host has them.
HOST_FILES = ("/etc/resolv.conf", "/etc/hosts")
#: The PATH a member gets when neither the image nor the Job sets one (Docker's default).
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

#: The driver libraries a CUDA workload needs: libnvidia-container's "utility" and "compute"
#: capabilities (src/nvc_info.c: utility_libs, compute_libs), the default of CUDA images.
DRIVER_LIBRARIES = (
    "libnvidia-ml.so", "libnvidia-cfg.so", "libnvidia-nscq.so",
    "libcuda.so", "libcudadebugger.so", "libnvidia-opencl.so", "libnvidia-gpucomp.so",
    "libnvidia-ptxjitcompiler.so", "libnvidia-fatbinaryloader.so", "libnvidia-allocator.so",
    "libnvidia-compiler.so", "libnvidia-pkcs11.so", "libnvidia-pkcs11-openssl3.so",
    "libnvidia-nvvm.so",
)  # fmt: skip
#: The driver tools of the same capabilities (utility_bins, compute_bins), less the daemons a
#: workload never runs (nvidia-persistenced, nv-fabricmanager belong to the Node).
DRIVER_BINARIES = (
    "nvidia-smi", "nvidia-debugdump", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server",
)  # fmt: skip

Kind = Literal["dir", "file", "link", "missing"]


class ImageSandboxError(ValueError):
    """The image cannot be run as asked. ``str()`` names what was wrong and how to fix it."""


def image_command(config: ImageConfig, command: Sequence[str]) -> tuple[str, ...]:
    """What the member's process execs inside the image, as Docker does for ``docker run IMAGE
    [COMMAND]``: the recipe's command replaces the image's ``Cmd`` and is appended to its
    ``Entrypoint`` (so an entrypoint script that ends in ``exec "$@"`` still runs first). With no
    recipe command, ``Entrypoint`` + ``Cmd``. A bare name is looked up on the member's PATH
    inside the image.
    """
    argv = (*config.entrypoint, *command) if command else (*config.entrypoint, *config.cmd)
    if not argv:
        raise ImageSandboxError(
            "The image has no Entrypoint and no Cmd, and the recipe gives no command; give the "
            "recipe an entrypoint or use an image that names a command."
        )
    return argv


def image_cwd(config: ImageConfig, command: Sequence[str], work_dir: Path) -> str:
    """The directory the member's process starts in, inside the image.

    A recipe command runs in the member's work directory, as on a host runtime: the Job
    Capsule and the experiment's files (``train.sh``) are there and the command names them
    relative to it. The image's own command (no recipe command) runs in the image's
    ``WorkingDir`` (``/`` when unset), as Docker runs it.
    """
    if command:
        return str(work_dir)
    return config.working_dir or "/"


@attrs.frozen
class DriverFiles:
    """The host's NVIDIA driver files a member with GPUs sees: ``(name inside, host path)``.

    ``libraries`` go to :data:`NVIDIA_LIB_DIR` under the name the loader looks for (the soname,
    ``libcuda.so.1``, and the development name, ``libcuda.so``, each bound to the file the host's
    link points at); ``binaries`` to :data:`NVIDIA_BIN_DIR`.
    """

    libraries: tuple[tuple[str, str], ...] = ()
    binaries: tuple[tuple[str, str], ...] = ()


@attrs.frozen
class LdCacheEntry:
    """One line of ``ldconfig -p``: a library name, its flags (``libc6,x86-64``) and path."""

    name: str
    flags: str
    path: str


def parse_ldconfig(text: str) -> tuple[LdCacheEntry, ...]:
    """The entries of ``ldconfig -p`` output, in its order (the loader's order of preference).

    Lines look like ``\\tlibcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1``;
    the count at the top and the "Cache generated by" line at the end are skipped.
    """
    entries = []
    for line in text.splitlines():
        head, arrow, path = line.strip().partition(" => ")
        if not arrow or not head.endswith(")") or " (" not in head:
            continue
        name, _, flags = head[:-1].partition(" (")
        if name and path.startswith("/"):
            entries.append(LdCacheEntry(name, flags, path))
    return tuple(entries)


def _is_driver_library(name: str) -> bool:
    return any(name == lib or name.startswith(lib + ".") for lib in DRIVER_LIBRARIES)


def driver_library_candidates(
    entries: Sequence[LdCacheEntry], arch_flag: str
) -> tuple[LdCacheEntry, ...]:
    """The cache entries of this machine's architecture (``x86-64`` in the flags; 32-bit
    entries have none) that name a driver library, first of each name only."""
    seen: set[str] = set()
    chosen = []
    for entry in entries:
        flags = [flag.strip() for flag in entry.flags.split(",")]
        if arch_flag not in flags or not _is_driver_library(entry.name) or entry.name in seen:
            continue
        seen.add(entry.name)
        chosen.append(entry)
    return tuple(chosen)


def select_driver_libraries(
    candidates: Sequence[tuple[LdCacheEntry, str]], driver_version: str
) -> tuple[tuple[str, str], ...]:
    """``(name inside, host file)`` for each candidate whose real file (the second of each pair,
    the link resolved) belongs to the running driver: its name ends in ``.so.<driver_version>``
    (``libcuda.so.550.54.15``), as libnvidia-container checks, so a library a previous driver
    left behind is never bound. An unknown version ("") keeps every candidate.
    """
    chosen = []
    for entry, real in candidates:
        if driver_version and not posixpath.basename(real).endswith(f".so.{driver_version}"):
            continue
        chosen.append((entry.name, real))
    return tuple(chosen)


@attrs.frozen
class SignalHelper:
    """The host's GNU ``env`` (coreutils 8.31 or later, for ``--default-signal``), its ELF
    interpreter (``""`` when ``env`` is static) and the libraries it needs, ``(soname, host
    path)``: bound into :data:`HELPER_DIR` and run through that interpreter, it restores
    SIGTERM in any image, whatever C library (or none) the image has.

    ``--library-path`` replaces ``LD_LIBRARY_PATH`` for ``env`` alone; what it execs is loaded
    by the image's own loader with the member's environment.
    """

    env: str
    interpreter: str = ""
    libraries: tuple[tuple[str, str], ...] = ()

    def argv(self) -> tuple[str, ...]:
        """The argv prefix, inside the image, that restores SIGTERM and execs what follows."""
        reset = (HELPER_ENV, "--default-signal=TERM")
        if not self.interpreter:
            return reset
        return (HELPER_LOADER, "--library-path", HELPER_LIB_DIR, *reset)


def parse_ldd(text: str, program: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """``(interpreter, ((soname, path), ...))`` from ``ldd program`` output.

    ``linux-vdso.so.1`` (in the kernel) is skipped; a static program has no interpreter and no
    libraries. A library ldd cannot find is an error naming it.
    """
    interpreter = ""
    libraries = []
    for line in text.splitlines():
        line = line.strip()
        if not line or "statically linked" in line or "not a dynamic executable" in line:
            continue
        name, arrow, rest = line.partition(" => ")
        if arrow:
            path = rest.split(" (", 1)[0].strip()
            if path == "not found" or not path.startswith("/"):
                raise ImageSandboxError(
                    f"{program} needs {name.strip()}, which this Node's loader cannot find "
                    f"(ldd says {line!r}); reinstall the package that provides {program}."
                )
            libraries.append((name.strip(), path))
        elif line.startswith("/"):
            interpreter = line.split(" (", 1)[0].strip()
    return interpreter, tuple(libraries)


@attrs.frozen
class MountPoint:
    """A path the sandbox mounts on (or creates) inside the image, and what it must be."""

    path: str
    kind: Literal["dir", "file"]


@attrs.frozen
class Entry:
    """One entry of an image directory: its name, kind and, for a link, its target."""

    name: str
    kind: Literal["dir", "file", "link"]
    target: str = ""


@attrs.frozen
class ImageTree:
    """What the sandbox knows of the image root, read by ``image_host.probe_image``.

    ``kinds``: for every mount point, the kind of each of its path's components in the image
    (links not followed), down to the first one that is not a directory. ``listings``: the
    entries of each directory that gets an underlay (:func:`underlays`).
    """

    root: Path
    kinds: Mapping[str, Kind]
    listings: Mapping[str, tuple[Entry, ...]] = attrs.field(factory=dict)


@attrs.frozen
class ImageSandbox:
    """Everything, besides the image itself, that decides the member's image sandbox.

    ``work_dir``, ``out_dir`` and ``telemetry_dir`` are host paths, bound writable at the same
    paths. ``devices`` are the member's own device nodes (``sandbox.gpu_devices``). ``host_files``
    are those of :data:`HOST_FILES` the host has. ``driver`` is empty for a member without GPUs.
    ``cwd`` is :func:`image_cwd`'s answer.
    """

    root: Path
    work_dir: Path
    out_dir: Path
    telemetry_dir: Path
    devices: tuple[str, ...]
    host_files: tuple[str, ...]
    driver: DriverFiles
    helper: SignalHelper
    cwd: str


def _components(path: str) -> list[str]:
    """``/a/b/c`` -> ``["/a", "/a/b", "/a/b/c"]``."""
    parts = [part for part in path.split("/") if part]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def _writable(sandbox: ImageSandbox) -> tuple[str, ...]:
    """The writable folders, one bind each: a folder inside another is already bound with it."""
    folders = sorted({str(sandbox.work_dir), str(sandbox.out_dir), str(sandbox.telemetry_dir)})
    kept: list[str] = []
    for folder in folders:
        if not any(folder.startswith(outer.rstrip("/") + "/") for outer in kept):
            kept.append(folder)
    return tuple(kept)


def _bound_files(sandbox: ImageSandbox) -> list[tuple[str, str]]:
    """``(path inside, host path)`` of every host file bound into the image, bar /etc's."""
    files = [(f"{NVIDIA_LIB_DIR}/{name}", path) for name, path in sandbox.driver.libraries]
    files += [(f"{NVIDIA_BIN_DIR}/{name}", path) for name, path in sandbox.driver.binaries]
    helper = sandbox.helper
    files.append((HELPER_ENV, helper.env))
    if helper.interpreter:
        files.append((HELPER_LOADER, helper.interpreter))
    files += [(f"{HELPER_LIB_DIR}/{name}", path) for name, path in helper.libraries]
    return files


def _on_private(path: str) -> bool:
    """Whether ``path`` lies on a tmpfs of the sandbox's own (under ``/tmp`` or ``/dev``), where
    it is made without the image's help."""
    return any(path.startswith(folder + "/") for folder in PRIVATE_TMPFS)


def _folders(sandbox: ImageSandbox) -> list[str]:
    """The folders that must exist inside: the writable ones and the working directory."""
    folders = list(_writable(sandbox))
    if sandbox.cwd != "/" and sandbox.cwd not in folders:
        folders.append(sandbox.cwd)
    return folders


def mount_points(sandbox: ImageSandbox) -> tuple[MountPoint, ...]:
    """Every path the image must have, with the right kind, for the sandbox to mount on it (the
    image is read for these; paths under the sandbox's own ``/tmp`` and ``/dev`` need nothing)."""
    points = [MountPoint(path, "dir") for path in ("/dev", "/proc", "/tmp")]
    points += [MountPoint(path, "dir") for path in _folders(sandbox)]
    points += [MountPoint(path, "file") for path in sandbox.host_files]
    # One mount point per bound file, not per folder: an image that happens to have one of
    # these folders still gets an underlay there for the files it lacks.
    points += [MountPoint(inside, "file") for inside, _ in _bound_files(sandbox)]
    unique: dict[str, MountPoint] = {}
    for point in points:
        if not _on_private(point.path):
            unique.setdefault(point.path, point)
    return tuple(unique.values())


def _underlay_of(point: MountPoint, kinds: Mapping[str, Kind]) -> tuple[str, str] | None:
    """``(underlay directory, the entry of it the mount point replaces)``, or None when the image
    already has the mount point with the right kind."""
    parent = "/"
    for path in _components(point.path):
        kind = kinds.get(path, "missing")
        last = path == point.path
        if kind == "dir" and (not last or point.kind == "dir"):
            parent = path
            continue
        if last and kind == "file" and point.kind == "file":
            return None
        return parent, posixpath.basename(path)
    return None


def underlays(points: Sequence[MountPoint], kinds: Mapping[str, Kind]) -> dict[str, frozenset[str]]:
    """Each image directory that needs an underlay, and the names of its entries that mount
    points replace (a missing name, or a link or file where a directory must be)."""
    found: dict[str, set[str]] = {}
    for point in points:
        where = _underlay_of(point, kinds)
        if where is not None:
            found.setdefault(where[0], set()).add(where[1])
    return {folder: frozenset(names) for folder, names in found.items()}


def _depth(path: str) -> int:
    return 0 if path == "/" else path.count("/")


def _created_dirs(
    points: Sequence[MountPoint], kinds: Mapping[str, Kind], folders: Sequence[str]
) -> list[str]:
    """The directories the sandbox makes: on an underlay, every component of a mount point below
    the image's last directory on its path (the mount point itself when it is a directory); on
    the sandbox's own ``/tmp``, every component of a folder below it."""
    made: list[str] = []
    for folder in folders:
        if _on_private(folder):
            made += [path for path in _components(folder)[1:] if path not in made]
    for point in points:
        if _underlay_of(point, kinds) is None:
            continue
        paths = _components(point.path)
        if point.kind == "file":
            paths = paths[:-1]
        for path in paths:
            if kinds.get(path, "missing") != "dir" and path not in made:
                made.append(path)
    return sorted(made, key=_depth)


def bwrap_argv(sandbox: ImageSandbox, tree: ImageTree) -> tuple[str, ...]:
    """The argv prefix that runs a command inside the image (``--``, then the SIGTERM reset).

    ``tree`` must be the image read for :func:`mount_points` of this ``sandbox``.
    """
    if tree.root != sandbox.root:
        raise ImageSandboxError(
            f"The image was read at {tree.root} but the sandbox runs {sandbox.root}; read the "
            "image the sandbox runs."
        )
    points = mount_points(sandbox)
    layers = underlays(points, tree.kinds)
    root = str(sandbox.root)
    argv = [BWRAP, "--ro-bind", root, "/"]
    for folder in sorted(layers, key=_depth):
        if folder not in tree.listings:
            raise ImageSandboxError(
                f"The image {root} was read without the entries of {folder}, which needs an "
                "underlay; read it with image_host.probe_image for these mount points."
            )
        argv += ["--tmpfs", folder]
        for entry in sorted(tree.listings[folder], key=lambda e: e.name):
            if entry.name in layers[folder]:
                continue
            inside = posixpath.join(folder, entry.name)
            if entry.kind == "link":
                argv += ["--symlink", entry.target, inside]
            else:
                argv += ["--ro-bind", root + inside, inside]
    argv += [
        "--dev", "/dev",
        "--tmpfs", "/dev/shm",
        "--proc", "/proc",
        "--tmpfs", "/tmp",
        "--unshare-pid",
        "--unshare-ipc",
    ]  # fmt: skip
    # After the sandbox's own /tmp, so the folders made under it are made on it.
    for folder in _created_dirs(points, tree.kinds, _folders(sandbox)):
        argv += ["--dir", folder]
    for device in sandbox.devices:
        argv += ["--dev-bind", device, device]
    for path in sandbox.host_files:
        argv += ["--ro-bind", path, path]
    for inside, path in _bound_files(sandbox):
        argv += ["--ro-bind", path, inside]
    for folder in _writable(sandbox):
        argv += ["--bind", folder, folder]
    # Last, once every mount point exists: an underlay is as read-only as the image under it
    # (a remount is not recursive, so the writable binds on it stay writable).
    for folder in sorted(layers, key=_depth):
        argv += ["--remount-ro", folder]
    argv += ["--chdir", sandbox.cwd, "--", *sandbox.helper.argv()]
    return tuple(argv)


def image_env(
    config: ImageConfig,
    job_env: Mapping[str, str],
    tuneplane_env: Mapping[str, str],
    home: str,
    driver: DriverFiles,
) -> dict[str, str]:
    """The base environment of a member's processes inside the image; nothing of the agent's.

    In order, later winning: the image's ``Env``; the Job's ``env`` (as ``docker run -e``
    overrides an image's ENV); what TunePlane owns, ``TUNEPLANE_*`` and the rest of
    ``tuneplane_env`` (its telemetry and TensorBoard directories), and ``HOME`` (the member's
    work directory). ``PATH`` is the image's or the Job's (Docker's default when neither sets
    one), with :data:`NVIDIA_BIN_DIR` appended when the driver's tools are bound;
    ``LD_LIBRARY_PATH`` gets :data:`NVIDIA_LIB_DIR` first when the driver's libraries are bound,
    so the host's driver wins over any copy in the image. The launcher then adds ranks and the
    rendezvous, and the runner the SDK on PYTHONPATH, as for host runtimes.
    """
    env: dict[str, str] = {}
    for entry in config.env:
        name, _, value = entry.partition("=")
        env[name] = value
    env.update(job_env)
    env.update(tuneplane_env)
    env["HOME"] = home
    path = env.get("PATH") or DEFAULT_PATH
    if driver.binaries and NVIDIA_BIN_DIR not in path.split(":"):
        path = f"{path}:{NVIDIA_BIN_DIR}"
    env["PATH"] = path
    if driver.libraries:
        search = [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d and d != NVIDIA_LIB_DIR]
        env["LD_LIBRARY_PATH"] = ":".join([NVIDIA_LIB_DIR, *search])
    return env


def host_files_present(present: Collection[str]) -> tuple[str, ...]:
    """Those of :data:`HOST_FILES` in ``present`` (the host files that exist), in order."""
    return tuple(path for path in HOST_FILES if path in present)
