"""Checking what an operator gives for a Fleet of kind ``slurm`` before anything is stored.

Rules: :func:`check_settings` is local (no network): the URL's form, the token file (an absolute
path to a readable file holding a Slurm JWT) and the partition name's form, each refused with a
sentence naming the flag. :func:`probe_settings` then asks slurmrestd itself: it answers in a
version this coordinator speaks, accepts the token, and has the partition.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

from tuneplane.coordinator.values.fleet import SlurmSettings

from ._discovery import open_slurm_rest
from ._token import read_token_file, token_user
from ._values import SlurmNode

# Slurm partition names: no spaces, commas or shell metacharacters in practice.
_PARTITION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class SlurmSettingsError(ValueError):
    """A setting of a Fleet of kind ``slurm`` is wrong; the message says which and how to fix it."""


def read_token(token_file: str) -> str:
    """The token in ``token_file``; :class:`SlurmSettingsError` when it cannot be read."""
    try:
        text = Path(token_file).read_text(encoding="utf-8")
    except OSError as error:
        raise SlurmSettingsError(
            f"The Slurm token file {token_file} cannot be read ({error.strerror or error}); "
            "write the token from `scontrol token` there, readable by the coordinator."
        ) from None
    return read_token_file(text)


def check_settings(
    slurmrestd: str,
    token_file: str,
    partition: str,
    shared_dir: str = "",
    python: str = "python3",
    spool_dir: str = "",
    image_root: str = "",
    registries_file: str = "",
) -> SlurmSettings:
    """The settings, with the token file made absolute, or :class:`SlurmSettingsError`."""
    url = urlsplit(slurmrestd)
    if url.scheme not in ("http", "https") or not url.hostname or url.path not in ("", "/"):
        raise SlurmSettingsError(
            f"--slurmrestd {slurmrestd!r} is not a slurmrestd URL; give http://HOST:PORT or "
            "https://HOST:PORT, with no path."
        )
    try:
        _ = url.port
    except ValueError:
        raise SlurmSettingsError(
            f"--slurmrestd {slurmrestd!r} has a port that is not a number; give HOST:PORT."
        ) from None
    path = Path(token_file).expanduser().absolute()
    token = read_token(str(path))
    token_user(token)  # a Slurm JWT naming its user, or a sentence saying what it is not
    if not _PARTITION.match(partition):
        raise SlurmSettingsError(
            f"--partition {partition!r} is not a Slurm partition name; give the name `sinfo` "
            "lists in its PARTITION column, without the default's '*'."
        )
    if shared_dir and not Path(shared_dir).is_absolute():
        raise SlurmSettingsError(
            f"--shared-dir {shared_dir!r} is not an absolute path; give the folder every Slurm "
            "node and the coordinator mount at the same path, e.g. /shared/tuneplane."
        )
    if shared_dir and not Path(shared_dir).is_dir():
        raise SlurmSettingsError(
            f"--shared-dir {shared_dir!r} is not a folder on the coordinator's machine; create "
            "it (on the storage the Slurm nodes mount at the same path) first."
        )
    if not python or any(c.isspace() for c in python):
        raise SlurmSettingsError(
            f"--python {python!r} is not an interpreter; give a name or an absolute path, with "
            "no spaces, of a Python with TunePlane installed on every Slurm node."
        )
    if spool_dir and not Path(spool_dir).is_absolute():
        raise SlurmSettingsError(
            f"--spool-dir {spool_dir!r} is not an absolute path; give a folder on each Slurm "
            "node's own storage, e.g. /var/spool/tuneplane."
        )
    check_image_settings(image_root, registries_file)
    return SlurmSettings(
        slurmrestd.rstrip("/"), str(path), partition, shared_dir, python, spool_dir,
        image_root=image_root, registries_file=registries_file,
    )  # fmt: skip


def check_image_settings(image_root: str, registries_file: str) -> None:
    """``--image-root`` and ``--registries-file``: absolute paths on the Slurm nodes (neither
    need exist on the coordinator's machine), the registries file only with an image root."""
    if image_root and not Path(image_root).is_absolute():
        raise SlurmSettingsError(
            f"--image-root {image_root!r} is not an absolute path; give a folder on each Slurm "
            "node's own storage where the step caches images, e.g. /var/cache/tuneplane-images."
        )
    if registries_file and not image_root:
        raise SlurmSettingsError(
            f"--registries-file {registries_file!r} is given without --image-root; a Fleet "
            "runs images only with a folder to cache them in, so add --image-root too."
        )
    if registries_file and not Path(registries_file).is_absolute():
        raise SlurmSettingsError(
            f"--registries-file {registries_file!r} is not an absolute path; give the path of "
            'the TOML file (node.toml\'s [registries."host:port"] tables) on every Slurm node.'
        )


async def probe_settings(settings: SlurmSettings) -> list[SlurmNode]:
    """The partition's nodes as slurmrestd reports them now; raises the package's
    :class:`~._errors.SlurmError` when slurmrestd is down, speaks no version we do, refuses the
    token or has no such partition."""
    rest = await open_slurm_rest(settings.slurmrestd, read_token(settings.token_file))
    try:
        await rest.ping()
        return await rest.partition_nodes(settings.partition)
    finally:
        await rest.aclose()
