"""Image manifests, image indexes and image configs read from bytes: what a pull fetches and in
which order, decided without any I/O.

Rules:
- A manifest or index is trusted only once its own bytes hash to the digest that named it
  (:func:`read_document`); a document larger than :data:`MAX_MANIFEST_BYTES` is refused before
  it is hashed, and so is a config larger than :data:`MAX_CONFIG_BYTES`.
- OCI and Docker v2 (schema 2) media types are read; Docker schema 1 is refused with a sentence.
  The document's ``mediaType`` field wins over the ``Content-Type`` the registry sent, which
  is only a fallback for documents that leave the field out.
- An index is resolved to one manifest for the Node's platform (``linux`` and the host's
  architecture in OCI's names: amd64, arm64...), preferring an exact variant match when asked;
  an index that has none names the platforms it does have.
- Every descriptor's digest is ``sha256:<64 hex>`` and its size is 0 or more: the cache uses the
  hex as a file name, so nothing else may reach it.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
from typing import Any

import attrs

from .image_errors import DigestMismatch, ManifestRefused

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MANIFEST_TYPES = frozenset({OCI_MANIFEST, DOCKER_MANIFEST})
INDEX_TYPES = frozenset({OCI_INDEX, DOCKER_LIST})
#: The Accept header of a manifest request: every document type this module reads.
ACCEPT = ", ".join((OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST, DOCKER_LIST))
#: Manifests and indexes are small JSON documents; a few MiB is far beyond any real one, so a
#: larger one is a broken or hostile registry, refused before it fills memory.
MAX_MANIFEST_BYTES = 4 << 20
#: An image config is JSON held in memory to read Env, Cmd and friends.
MAX_CONFIG_BYTES = 8 << 20
MAX_LAYERS = 1000
_HEX = re.compile(r"[0-9a-f]{64}")
_ARCHES = {
    "x86_64": "amd64",
    "amd64": "amd64",
    "aarch64": "arm64",
    "arm64": "arm64",
    "ppc64le": "ppc64le",
    "s390x": "s390x",
    "riscv64": "riscv64",
}


@attrs.frozen
class Platform:
    os: str
    architecture: str
    variant: str = ""

    def __str__(self) -> str:
        return "/".join(p for p in (self.os, self.architecture, self.variant) if p)


@attrs.frozen
class Descriptor:
    """A pointer to one blob (or child manifest): its media type, sha256 hex and size."""

    media_type: str
    digest_hex: str
    size: int
    platform: Platform | None = None

    @property
    def digest(self) -> str:
        return f"sha256:{self.digest_hex}"


@attrs.frozen
class Manifest:
    """One image for one platform: its config blob and its layers, bottom first."""

    media_type: str
    config: Descriptor
    layers: tuple[Descriptor, ...]

    @property
    def blobs(self) -> tuple[Descriptor, ...]:
        """Every blob the image needs, the config first."""
        return (self.config, *self.layers)


@attrs.frozen
class Index:
    """A multi-platform image: one manifest per platform."""

    media_type: str
    manifests: tuple[Descriptor, ...]


@attrs.frozen
class ImageConfig:
    """What of the image config says how a member's processes start in the image: ``env`` is
    its ``Env`` (``NAME=value`` strings, in order), ``working_dir`` its ``WorkingDir`` ("" when
    unset), ``entrypoint`` and ``cmd`` its ``Entrypoint`` and ``Cmd``. ``user`` is kept to be
    shown, never honoured (see :mod:`.image_sandbox`'s rules). Read by :func:`read_config`;
    :meth:`to_json` and :meth:`from_json` are its form in the cache's image record.
    """

    env: tuple[str, ...] = ()
    working_dir: str = ""
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    user: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "Env": list(self.env),
            "WorkingDir": self.working_dir,
            "Entrypoint": list(self.entrypoint),
            "Cmd": list(self.cmd),
            "User": self.user,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ImageConfig:
        return cls(
            env=tuple(data["Env"]),
            working_dir=data["WorkingDir"],
            entrypoint=tuple(data["Entrypoint"]),
            cmd=tuple(data["Cmd"]),
            user=data["User"],
        )


def host_platform() -> Platform:
    """This machine's platform in OCI's names (linux/amd64 on an x86_64 GPU box)."""
    machine = platform.machine().lower()
    return Platform("linux", _ARCHES.get(machine, machine))


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_document(data: bytes, content_type: str, digest_hex: str, where: str) -> Manifest | Index:
    """The manifest or index in ``data``, whose sha256 must be ``digest_hex``; ``where`` names
    it in errors (``registry.example/team/pytorch@sha256:…``)."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestRefused(
            f"The manifest of {where} is {len(data)} bytes, more than the {MAX_MANIFEST_BYTES} "
            "a Node reads; the registry is serving something that is not an image manifest."
        )
    actual = sha256_hex(data)
    if actual != digest_hex:
        raise DigestMismatch(
            f"The manifest the registry served for {where} has the digest sha256:{actual}, not "
            f"the sha256:{digest_hex} it was asked for; the registry is broken or tampered with, "
            "so the Node refuses it (pull again once the registry serves the right bytes)."
        )
    try:
        document = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestRefused(f"The manifest of {where} is not JSON ({exc}).") from None
    if not isinstance(document, dict):
        raise ManifestRefused(f"The manifest of {where} is not a JSON object.")
    media_type = document.get("mediaType") or content_type.split(";")[0].strip()
    if document.get("schemaVersion") == 1 or "signatures" in document:
        raise ManifestRefused(
            f"The manifest of {where} is Docker schema 1, which TunePlane does not run; push the "
            "image again with a current tool (it writes OCI or Docker schema 2)."
        )
    if media_type in INDEX_TYPES or (not media_type and "manifests" in document):
        entries = _list(document, "manifests", where)
        return Index(media_type or OCI_INDEX, tuple(_descriptor(e, where) for e in entries))
    if media_type in MANIFEST_TYPES or (not media_type and "layers" in document):
        layers = _list(document, "layers", where)
        if len(layers) > MAX_LAYERS:
            raise ManifestRefused(
                f"The image {where} has {len(layers)} layers, more than the {MAX_LAYERS} a Node "
                "unpacks; squash the image."
            )
        config = _descriptor(document.get("config"), where)
        return Manifest(
            media_type or OCI_MANIFEST, config, tuple(_descriptor(e, where) for e in layers)
        )
    raise ManifestRefused(
        f"The manifest of {where} has the media type {media_type!r}; TunePlane reads "
        f"{', '.join(sorted(MANIFEST_TYPES | INDEX_TYPES))}."
    )


def select_manifest(index: Index, want: Platform, where: str) -> Descriptor:
    """The index's manifest for the platform ``want`` (an exact variant first, then any)."""
    candidates = [
        d
        for d in index.manifests
        if d.platform is not None
        and d.platform.os == want.os
        and d.platform.architecture == want.architecture
        and d.media_type in MANIFEST_TYPES
    ]
    exact = [d for d in candidates if d.platform is not None and d.platform.variant == want.variant]
    chosen = exact or candidates
    if not chosen:
        have = ", ".join(str(d.platform) for d in index.manifests if d.platform) or "none"
        raise ManifestRefused(
            f"The image {where} has no manifest for {want} (it has: {have}); build and push the "
            f"image for {want}, or pin the digest of a manifest for it."
        )
    return chosen[0]


def read_config(data: bytes, where: str) -> ImageConfig:
    """Env, WorkingDir, Entrypoint, Cmd and User of the image config in ``data``, checked so
    that a member can be started from them (refused at pull time, not at launch)."""
    if len(data) > MAX_CONFIG_BYTES:
        raise ManifestRefused(
            f"The config of {where} is {len(data)} bytes, more than the {MAX_CONFIG_BYTES} a "
            "Node reads."
        )
    try:
        document = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestRefused(f"The config of {where} is not JSON ({exc}).") from None
    config = document.get("config") if isinstance(document, dict) else None
    if config is None:
        return ImageConfig()
    if not isinstance(config, dict):
        raise ManifestRefused(
            f"The config of {where} has a 'config' that is not an object; rebuild the image "
            "with a valid configuration."
        )

    def strings(key: str) -> tuple[str, ...]:
        value = config.get(key)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ManifestRefused(
                f"The config of {where} has {key} {value!r}, which is not a list of strings; "
                "rebuild the image with a valid configuration."
            )
        return tuple(value)

    def text(key: str) -> str:
        value = config.get(key)
        if value is None:
            return ""
        if not isinstance(value, str):
            raise ManifestRefused(
                f"The config of {where} has {key} {value!r}, which is not a string; rebuild "
                "the image with a valid configuration."
            )
        return value

    env = strings("Env")
    for entry in env:
        if "=" not in entry or entry.startswith("="):
            raise ManifestRefused(
                f"The config of {where} has an Env entry {entry!r} that is not NAME=value; "
                "rebuild the image with its ENV lines as NAME=value."
            )
    working_dir = text("WorkingDir")
    if working_dir and not working_dir.startswith("/"):
        raise ManifestRefused(
            f"The config of {where} has WorkingDir {working_dir!r}, which is not an absolute "
            "path; rebuild the image with an absolute WORKDIR."
        )
    return ImageConfig(
        env=env,
        working_dir=working_dir,
        entrypoint=strings("Entrypoint"),
        cmd=strings("Cmd"),
        user=text("User"),
    )


def _list(document: dict[str, Any], key: str, where: str) -> list[Any]:
    value = document.get(key)
    if not isinstance(value, list):
        raise ManifestRefused(f"The manifest of {where} has no list of {key}.")
    return value


def _descriptor(value: Any, where: str) -> Descriptor:
    if not isinstance(value, dict):
        raise ManifestRefused(f"The manifest of {where} has a descriptor that is not an object.")
    media_type, digest, size = value.get("mediaType"), value.get("digest"), value.get("size")
    algorithm, _, hex_digits = digest.partition(":") if isinstance(digest, str) else ("", "", "")
    if algorithm != "sha256" or not _HEX.fullmatch(hex_digits):
        raise ManifestRefused(
            f"The manifest of {where} has a descriptor with the digest {digest!r}; TunePlane "
            "pulls only blobs named sha256:<64 lowercase hex digits>."
        )
    if not isinstance(media_type, str) or type(size) is not int or size < 0:
        raise ManifestRefused(
            f"The manifest of {where} describes {digest} with media type {media_type!r} and "
            f"size {size!r}; a descriptor needs a media type and a size of 0 or more bytes."
        )
    found = value.get("platform")
    platform_ = None
    if isinstance(found, dict):
        platform_ = Platform(
            str(found.get("os", "")),
            str(found.get("architecture", "")),
            str(found.get("variant", "") or ""),
        )
    return Descriptor(media_type, hex_digits, size, platform_)


def expect(data: bytes, descriptor: Descriptor, what: str) -> None:
    """Raise :class:`DigestMismatch` unless ``data`` is the blob ``descriptor`` names."""
    actual = sha256_hex(data)
    if actual != descriptor.digest_hex or len(data) != descriptor.size:
        raise DigestMismatch(
            f"The {what} {descriptor.digest} read back as {len(data)} bytes with the digest "
            f"sha256:{actual}; expected {descriptor.size} bytes. The cache removes it and pulls "
            "it again."
        )
