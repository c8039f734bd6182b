"""Runtime image references: ``image:<registry>[:port]/<name>@sha256:<64 hex>``, and the tag form
``<registry>[:port]/<name>:<tag>`` that the coordinator resolves to a digest at Preview.

Rules (pure: no I/O):
- The registry is always written out: a host name with a dot, ``localhost``, an IPv4 address or a
  bracketed IPv6 address, with an optional port. There is no default registry, because a Node
  that guessed one would pull a different image than the researcher meant.
- The name is the OCI distribution spec's repository name (lowercase path components joined by
  ``.``, ``_``, ``__`` or dashes), at most 255 characters with the registry.
- A Node only ever pulls by digest (``sha256`` and 64 lowercase hex digits), so a retag never
  changes a Job; a tag is only accepted where it is parsed as a :class:`TaggedImage`.
- ``str()`` of a parsed reference is the text it was parsed from (with the ``image:`` prefix for
  :class:`ImageRef`), so references round-trip through JobSpecs and the journal.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re

import attrs

PREFIX = "image:"
_COMPONENT = r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*"
_NAME = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_HEX = re.compile(r"[0-9a-f]{64}")
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
#: The longest ``<registry>/<name>`` the distribution spec lets a registry accept.
MAX_NAME = 255
EXAMPLE = "image:registry.example/team/pytorch@sha256:<64 hex digits>"


class ImageRefError(ValueError):
    """An image reference that cannot be used; ``str()`` names it, what is wrong and the fix."""


@attrs.frozen
class ImageRef:
    """An image pinned by digest: what a Node pulls."""

    registry: str  # host[:port], as written
    name: str  # the repository, e.g. "team/pytorch"
    digest_hex: str  # 64 lowercase hex digits of the manifest's sha256

    @property
    def digest(self) -> str:
        return f"sha256:{self.digest_hex}"

    def __str__(self) -> str:
        return f"{PREFIX}{self.registry}/{self.name}@{self.digest}"


@attrs.frozen
class TaggedImage:
    """An image named by tag, before the coordinator resolves it to an :class:`ImageRef`."""

    registry: str
    name: str
    tag: str

    def pinned(self, digest_hex: str) -> ImageRef:
        """The same image pinned to the manifest digest the registry answered for the tag."""
        return ImageRef(self.registry, self.name, _digest_hex(f"sha256:{digest_hex}", str(self)))

    def __str__(self) -> str:
        return f"{self.registry}/{self.name}:{self.tag}"


def parse_image_ref(text: str) -> ImageRef:
    """``image:<registry>[:port]/<name>@sha256:<hex>`` (the ``image:`` prefix may be left out)."""
    body = text.removeprefix(PREFIX)
    where, at, digest = body.rpartition("@")
    if not at:
        tagged = ""
        with contextlib.suppress(ImageRefError):
            tagged = f" (resolve the tag {parse_tagged_image(body).tag!r} at Preview)"
        raise ImageRefError(
            f"The image reference {text!r} names no digest{tagged}; a Node pulls images only "
            f"by digest, written as {EXAMPLE}."
        )
    registry, name = _registry_and_name(where, text)
    return ImageRef(registry, name, _digest_hex(digest, text))


def parse_tagged_image(text: str) -> TaggedImage:
    """``<registry>[:port]/<name>:<tag>``, the form a researcher may write before Preview."""
    body = text.removeprefix(PREFIX)
    if "@" in body:
        raise ImageRefError(
            f"The image reference {text!r} has a digest; parse it as a pinned reference "
            "(parse_image_ref) instead of resolving a tag."
        )
    slash = body.find("/")
    colon = body.rfind(":")
    if colon <= slash:
        raise ImageRefError(
            f"The image reference {text!r} names no tag; write <registry>/<name>:<tag> "
            f"(registry.example/team/pytorch:2.4) or pin it as {EXAMPLE}."
        )
    registry, name = _registry_and_name(body[:colon], text)
    tag = body[colon + 1 :]
    if not _TAG.fullmatch(tag):
        raise ImageRefError(
            f"The image reference {text!r} has the tag {tag!r}, which is not a tag: a tag is "
            "1 to 128 letters, digits, '_', '.' or '-', not starting with '.' or '-'."
        )
    return TaggedImage(registry, name, tag)


def is_registry(text: str) -> bool:
    """Whether ``text`` is a registry as an image reference writes it: ``host[:port]``, the host
    a name with a dot, ``localhost`` or an IP address (a bracketed IPv6 one)."""
    try:
        _check_registry(text, text)
    except ImageRefError:
        return False
    return bool(text) and "/" not in text


def _registry_and_name(where: str, text: str) -> tuple[str, str]:
    registry, slash, name = where.partition("/")
    if not slash or not registry:
        raise ImageRefError(
            f"The image reference {text!r} does not start with a registry; write the registry "
            f"out, as in {EXAMPLE}."
        )
    _check_registry(registry, text)
    if not _NAME.fullmatch(name):
        raise ImageRefError(
            f"The image reference {text!r} has the repository name {name!r}, which the OCI "
            "distribution spec does not allow: lowercase letters and digits in '/'-separated "
            "components, joined inside a component by '.', '_', '__' or dashes."
        )
    if len(registry) + 1 + len(name) > MAX_NAME:
        raise ImageRefError(
            f"The image reference {text!r} is longer than {MAX_NAME} characters before the "
            "digest; registries refuse such names, so use a shorter repository name."
        )
    return registry, name


def _check_registry(registry: str, text: str) -> None:
    host, port = registry, ""
    if registry.startswith("["):
        close = registry.find("]")
        host, rest = registry[: close + 1], registry[close + 1 :]
        if close < 0 or (rest and not rest.startswith(":")):
            host, rest = "", ""
        port = rest[1:]
    elif ":" in registry:
        host, _, port = registry.partition(":")
    if port and not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ImageRefError(
            f"The image reference {text!r} has the registry port {port!r}; a port is a number "
            "from 1 to 65535."
        )
    if registry.endswith(":") or not _is_host(host, has_port=bool(port)):
        raise ImageRefError(
            f"The image reference {text!r} starts with {registry!r}, which is not a registry: "
            "write a host name with a dot, localhost, or an IP address, with an optional "
            f":port, as in {EXAMPLE}."
        )


def _is_host(host: str, has_port: bool) -> bool:
    if host.startswith("[") and host.endswith("]"):
        try:
            return ipaddress.ip_address(host[1:-1]).version == 6
        except ValueError:
            return False
    labels = host.split(".")
    if not host or len(host) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        return False
    # A first component without a dot or a port is a repository path in other tools' syntax
    # ("library/ubuntu"); refusing it keeps a Node from guessing Docker Hub.
    return len(labels) > 1 or host == "localhost" or has_port


def _digest_hex(digest: str, text: str) -> str:
    algorithm, colon, hex_digits = digest.partition(":")
    if algorithm != "sha256" or not colon:
        raise ImageRefError(
            f"The image reference {text!r} has the digest {digest!r}; TunePlane pins images by "
            "sha256 only, written sha256:<64 hex digits>."
        )
    if not _HEX.fullmatch(hex_digits):
        raise ImageRefError(
            f"The image reference {text!r} has the digest {digest!r}, which is not 64 lowercase "
            "hex digits after sha256:; copy the digest the registry printed for the push."
        )
    return hex_digits
