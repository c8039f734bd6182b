"""What the image sandbox reads from the Node and the image (the I/O half of :mod:`.image_sandbox`).

Rules: nothing here writes anything. An image root is read without following its links: each
path is walked one component at a time from the root with ``lstat`` and the walk stops at the
first component that is not a directory, so an image's link (``etc -> /etc``) never leads a read
to the host. Driver files are found as libnvidia-container finds them: libraries in the loader's
cache (``ldconfig -p``), tools in the system's binary folders.
"""

from __future__ import annotations

import functools
import os
import platform
import stat
import subprocess
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import attrs

from .image_manifest import ImageConfig
from .image_sandbox import (
    DRIVER_BINARIES,
    HOST_FILES,
    DriverFiles,
    Entry,
    ImageSandbox,
    ImageSandboxError,
    ImageTree,
    Kind,
    MountPoint,
    SignalHelper,
    bwrap_argv,
    driver_library_candidates,
    host_files_present,
    image_command,
    image_cwd,
    image_env,
    mount_points,
    parse_ldconfig,
    parse_ldd,
    select_driver_libraries,
    underlays,
)
from .inventory import Gpu
from .sandbox import gpu_devices

LDCONFIG = "/sbin/ldconfig"
LDD = "/usr/bin/ldd"
HOST_ENV = "/usr/bin/env"
#: Where the driver's tools are looked for (nvidia-smi and its kin; never the agent's PATH).
BINARY_DIRS = ("/usr/bin", "/usr/sbin", "/bin", "/sbin")
#: The ``ldconfig -p`` flag of this machine's own libraries, by ``platform.machine()``.
ARCH_FLAGS = {"x86_64": "x86-64", "aarch64": "AArch64", "ppc64le": "64bit"}
_TIMEOUT_S = 30


def _kind(mode: int) -> Kind:
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "link"
    return "file"


def probe_image(root: Path, points: Sequence[MountPoint]) -> ImageTree:
    """Read what the sandbox needs of the image at ``root`` for these mount points."""
    top = os.lstat(root)
    if not stat.S_ISDIR(top.st_mode):
        raise ImageSandboxError(
            f"The image root {root} is not a directory; unpack the image again."
        )
    kinds: dict[str, Kind] = {"/": "dir"}
    for point in points:
        parts = [part for part in point.path.split("/") if part]
        path = ""
        for part in parts:
            path += "/" + part
            if path not in kinds:
                try:
                    kinds[path] = _kind(os.lstat(f"{root}{path}").st_mode)
                except FileNotFoundError:
                    kinds[path] = "missing"
            if kinds[path] != "dir":
                break
    listings: dict[str, tuple[Entry, ...]] = {}
    for folder in underlays(points, kinds):
        entries = []
        with os.scandir(f"{root}{folder}" if folder != "/" else root) as found:
            for item in found:
                if item.is_symlink():
                    entries.append(Entry(item.name, "link", os.readlink(item.path)))
                elif item.is_dir(follow_symlinks=False):
                    entries.append(Entry(item.name, "dir"))
                else:
                    entries.append(Entry(item.name, "file"))
        listings[folder] = tuple(entries)
    return ImageTree(root, kinds, listings)


def find_driver_files(
    driver_version: str,
    *,
    ldconfig_output: str | None = None,
    binary_dirs: Sequence[str] = BINARY_DIRS,
) -> DriverFiles:
    """The host's NVIDIA driver libraries and tools a member with GPUs gets.

    Libraries: the loader's cache (``ldconfig -p``, or ``ldconfig_output`` when given) for this
    machine's architecture, each name's link resolved and kept only when the file belongs to
    ``driver_version`` (:func:`.image_sandbox.select_driver_libraries`). Tools: the first of
    each of :data:`.image_sandbox.DRIVER_BINARIES` in ``binary_dirs``. A machine without the
    driver gets empty lists, never an error: its members have no GPUs to use them with.
    """
    if ldconfig_output is None:
        done = subprocess.run(
            [LDCONFIG, "-p"], capture_output=True, text=True, timeout=_TIMEOUT_S, check=False
        )
        ldconfig_output = done.stdout
    arch = ARCH_FLAGS.get(platform.machine(), platform.machine())
    candidates = driver_library_candidates(parse_ldconfig(ldconfig_output), arch)
    resolved = [(entry, os.path.realpath(entry.path)) for entry in candidates]
    libraries = select_driver_libraries(
        [(entry, real) for entry, real in resolved if os.path.isfile(real)], driver_version
    )
    binaries = []
    for name in DRIVER_BINARIES:
        for folder in binary_dirs:
            path = os.path.join(folder, name)
            if os.path.isfile(path) and os.access(path, os.X_OK):
                binaries.append((name, os.path.realpath(path)))
                break
    return DriverFiles(libraries, tuple(binaries))


@functools.cache
def signal_helper(env: str = HOST_ENV) -> SignalHelper:
    """The host's ``env`` with what it needs to run inside any image (see :class:`SignalHelper`).

    Refused with a sentence when ``env`` has no ``--default-signal`` (GNU coreutils before 8.31)
    or its libraries cannot be found.
    """
    try:
        works = subprocess.run(
            [env, "--default-signal=TERM", "true"], capture_output=True, timeout=_TIMEOUT_S,
            check=False,
        ).returncode == 0  # fmt: skip
    except OSError:
        works = False
    if not works:
        raise ImageSandboxError(
            f"{env} cannot restore SIGTERM (`env --default-signal`, GNU coreutils 8.31 or "
            "later), which a member in an image needs; upgrade coreutils on this Node."
        )
    done = subprocess.run(
        [LDD, env], capture_output=True, text=True, timeout=_TIMEOUT_S, check=False
    )
    interpreter, libraries = parse_ldd(done.stdout + done.stderr, env)
    return SignalHelper(
        os.path.realpath(env),
        os.path.realpath(interpreter) if interpreter else "",
        tuple((name, os.path.realpath(path)) for name, path in libraries),
    )


def host_files() -> tuple[str, ...]:
    """The files of :data:`.image_sandbox.HOST_FILES` this host has."""
    return host_files_present({path for path in HOST_FILES if os.path.isfile(path)})


def member_sandbox(
    *,
    root: Path,
    work_dir: Path,
    out_dir: Path,
    telemetry_dir: Path,
    gpus: Sequence[Gpu],
    driver_version: str,
    config: ImageConfig,
    command: Sequence[str],
) -> ImageSandbox:
    """The :class:`ImageSandbox` of a member with these GPUs on this host: its own device nodes
    among those present, the driver's files only when it has GPUs, the host's resolv.conf and
    hosts, the host's ``env`` for the SIGTERM reset, and its working directory."""
    return sandbox_of(
        root=root, work_dir=work_dir, out_dir=out_dir, telemetry_dir=telemetry_dir,
        devices=gpu_devices(gpus, present_devices()),
        driver=find_driver_files(driver_version) if gpus else DriverFiles(),
        config=config, command=command,
    )  # fmt: skip


def sandbox_of(
    *,
    root: Path,
    work_dir: Path,
    out_dir: Path,
    telemetry_dir: Path,
    devices: tuple[str, ...],
    driver: DriverFiles,
    config: ImageConfig,
    command: Sequence[str],
) -> ImageSandbox:
    """The :class:`ImageSandbox` of a member given its device nodes and driver files: the
    host's resolv.conf and hosts, the host's ``env`` for the SIGTERM reset, its working
    directory."""
    return ImageSandbox(
        root=root,
        work_dir=work_dir,
        out_dir=out_dir,
        telemetry_dir=telemetry_dir,
        devices=devices,
        host_files=host_files(),
        driver=driver,
        helper=signal_helper(),
        cwd=image_cwd(config, command, work_dir),
    )


@attrs.frozen
class ImageLaunch:
    """How a member's processes run in its image: their base environment, the command they
    exec inside it, and the bubblewrap argv prefix that puts them there."""

    env: dict[str, str]
    entrypoint: tuple[str, ...]
    wrapper: tuple[str, ...]


def image_launch(
    box: ImageSandbox,
    config: ImageConfig,
    command: Sequence[str],
    job_env: Mapping[str, str],
    ours: Mapping[str, str],
) -> ImageLaunch:
    """What a Node (agent/members_launch.py) and a Slurm step (agent/slurm_image.py) both plan
    a member in an image with: the image's Env, then the Job's, then TunePlane's
    (:func:`.image_sandbox.image_env`); the recipe's command after the image's Entrypoint
    (:func:`.image_sandbox.image_command`); the sandbox's argv with the image read for its
    mount points. Raises :class:`ImageSandboxError`."""
    return ImageLaunch(
        env=image_env(config, job_env, ours, str(box.work_dir), box.driver),
        entrypoint=image_command(config, command),
        wrapper=image_bwrap_argv(box),
    )


def image_bwrap_argv(sandbox: ImageSandbox) -> tuple[str, ...]:
    """The sandbox's argv prefix, with the image read for its mount points."""
    return bwrap_argv(sandbox, probe_image(sandbox.root, mount_points(sandbox)))


def present_devices() -> Collection[str]:
    """The NVIDIA device nodes this host has (what ``sandbox.gpu_devices`` chooses from)."""
    return {str(path) for path in Path("/dev").glob("nvidia*")}
