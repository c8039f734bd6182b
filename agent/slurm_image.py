"""The image half of the Slurm step (agent/slurm_step.py): a member whose runtime is an image
(``image:<registry>/<name>@sha256:…``) runs in that image under bubblewrap, as on a Node.

Rules:
- The image is made ready under the Fleet's image root (``--image-root``, a folder on the
  node's own storage, in attempt.json), in the job user's own cache ``uid-<uid>``
  (:func:`user_cache`: owned by that user and writable by no one else, so no user can change
  the image another user's member runs in), by the Node's own cache
  (:class:`~.image_cache.ImageCache`): pulled, verified by digest and unpacked once. Several
  Slurm jobs of one user on one node share that folder, so the step holds an exclusive
  ``flock`` on :data:`LOCK_FILE` in it while it makes the image ready; a step that finds the
  image ready pulls nothing.
- The registries are reached as the Fleet's registries file says (``--registries-file``, on
  every node; node.toml's ``[registries."host:port"]`` tables, read by the same parser,
  :func:`~.config_registries.registries_settings`). No file: the system's CAs, no credentials.
- The sandbox and the processes' environment and command are planned by the functions a Node
  plans them with (:func:`~.image_host.sandbox_of`, :func:`~.image_host.image_launch`).
- GPUs: Slurm confines a job to its GPUs (cgroups) or gives it the node, so a member with GPUs
  gets every NVIDIA device node the node has, as a host runtime on Slurm sees them, and
  ``CUDA_VISIBLE_DEVICES`` names its GPUs as Slurm gave them. The driver's libraries and tools
  are those of the version NVML reports; where NVML cannot be read (no driver) the version is
  unknown and every driver library the loader's cache lists is bound (none on a node without
  the driver). A member without GPUs gets no device node and no driver file.
- Anything that keeps the image from running is a :class:`SlurmImageError` with a sentence:
  the step fails the member with it (exit 1).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path

import pynvml
import trio

from tuneplane.proto.contract.slurm_attempt import AttemptFile

from .collectors import telemetry_dir
from .config_registries import registries_settings
from .config_tables import NodeConfigError
from .image_access import RegistryAccess
from .image_cache import ImageCache, ReadyImage
from .image_errors import ImageError
from .image_host import ImageLaunch, find_driver_files, image_launch, present_devices, sandbox_of
from .image_ref import PREFIX, ImageRef, ImageRefError, parse_image_ref
from .image_sandbox import DriverFiles, ImageSandboxError
from .nvml_card import nvml_text

#: The file in the image root every Slurm step locks while it makes an image ready.
LOCK_FILE = "slurm-step.lock"


class SlurmImageError(RuntimeError):
    """The member's image cannot be run on this node; the message says why and what to fix."""


def image_of(runtime_id: str) -> ImageRef | None:
    """The image a resolved JobSpec's runtime pins (None for a ``host:`` runtime)."""
    if not runtime_id.startswith(PREFIX):
        return None
    try:
        return parse_image_ref(runtime_id)
    except ImageRefError as exc:
        raise SlurmImageError(str(exc)) from None


def read_registries(path: str) -> dict[str, RegistryAccess]:
    """How this node reaches registries, as the Fleet's registries file at ``path`` says
    (``""``: no file, every registry with the system's CAs and no credentials)."""
    if not path:
        return {}
    try:
        settings = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise SlurmImageError(
            f"The Fleet's registries file {path} cannot be read on this node ({exc}); put it on "
            'every Slurm node (node.toml\'s [registries."host:port"] tables) or create the '
            "Fleet with another --registries-file."
        ) from None
    extra = sorted(set(settings) - {"registries"})
    if extra:
        raise SlurmImageError(
            f"The Fleet's registries file {path} has {', '.join(extra)}, which it does not "
            'read; keep only [registries."host:port"] tables in it.'
        )
    try:
        return registries_settings(settings, Path(path))
    except NodeConfigError as exc:
        raise SlurmImageError(str(exc)) from None


def user_cache(image_root: Path, uid: int) -> Path:
    """This user's own image cache under the Fleet's image root: ``uid-<uid>``, a folder of
    its own (made 0700 when missing), never a link, owned by ``uid`` and writable by nobody
    else; :class:`SlurmImageError` otherwise, with nothing in it touched.

    Slurm jobs on one node run as different users, so a cache they shared would let one user
    change the image another user's member runs in. The image root itself is the operator's
    (mode 1777, like /tmp, so each user can make their own folder and remove no one else's)."""
    mine = image_root / f"uid-{uid}"
    try:
        image_root.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # checked below, whatever it is
            mine.mkdir(mode=0o700)
        found = mine.lstat()
    except OSError as exc:
        raise SlurmImageError(
            f"The Fleet's image root {image_root} cannot be used on this node ({exc}); make it "
            "a folder every Slurm user may create their own folder in (mode 1777, like /tmp) on "
            "every node, or create the Fleet with another --image-root."
        ) from None
    if (
        not stat.S_ISDIR(found.st_mode)
        or found.st_uid != uid
        or found.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    ):
        kind = "a link" if stat.S_ISLNK(found.st_mode) else (
            "a folder" if stat.S_ISDIR(found.st_mode) else "a file")  # fmt: skip
        raise SlurmImageError(
            f"The image cache {mine} is {kind} owned by uid {found.st_uid} with mode "
            f"{stat.S_IMODE(found.st_mode):04o}, not uid {uid}'s own folder that no one else can "
            f"write; an image in it cannot be trusted. Remove it (the step makes it again, 0700, "
            f"owned by uid {uid}) and find out who made it."
        )
    return mine


def ready_image(
    image_root: Path, registries: Mapping[str, RegistryAccess], ref: ImageRef
) -> ReadyImage:
    """The image ``ref`` ready in the cache at ``image_root``, pulled and unpacked there while
    this step holds the root's :data:`LOCK_FILE` when it is not ready yet."""
    cache = ImageCache(image_root, registries)
    try:
        image_root.mkdir(parents=True, exist_ok=True)
        with (image_root / LOCK_FILE).open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return trio.run(cache.ensure, ref)
    except ImageError as exc:
        raise SlurmImageError(f"The image {ref} cannot be had on this node: {exc}") from None
    except OSError as exc:
        raise SlurmImageError(
            f"The Fleet's image root {image_root} cannot be used on this node ({exc}); make it "
            "a folder the Slurm job's user can write on every node, or create the Fleet with "
            "another --image-root."
        ) from None


def driver_version() -> str:
    """The NVIDIA driver's version as NVML reports it; "" where NVML cannot be read."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return ""
    try:
        return nvml_text(pynvml.nvmlSystemGetDriverVersion())
    except pynvml.NVMLError:
        return ""
    finally:
        pynvml.nvmlShutdown()


def plan_image(
    attempt: AttemptFile,
    ref: ImageRef,
    work: Path,
    out_dir: Path,
    command: Sequence[str],
    job_env: Mapping[str, str],
    ours: Mapping[str, str],
) -> ImageLaunch:
    """How this node's member runs in the image ``ref``: the image made ready, then its
    environment, command and bubblewrap argv as a Node plans them."""
    if not attempt.image_root:
        raise SlurmImageError(
            f"The Job's runtime is the image {ref}, and attempt.json names no image root; the "
            "Fleet must be created with --image-root for image runtimes."
        )
    cache = user_cache(Path(attempt.image_root), os.getuid())
    image = ready_image(cache, read_registries(attempt.registries_file), ref)
    gpus = attempt.gpus_per_member > 0
    try:
        box = sandbox_of(
            root=image.root, work_dir=work, out_dir=out_dir, telemetry_dir=telemetry_dir(out_dir),
            devices=tuple(sorted(present_devices())) if gpus else (),
            driver=find_driver_files(driver_version()) if gpus else DriverFiles(),
            config=image.config, command=command,
        )  # fmt: skip
        return image_launch(box, image.config, command, job_env, ours)
    except ImageSandboxError as exc:
        raise SlurmImageError(str(exc)) from None
