"""Why a runtime image could not be made ready on this Node, one class per reason.

Every ``str()`` is a sentence for the researcher or the operator that names the image (and the
blob or the registry), says what was wrong and what to do. Prepare answers with it when it
refuses a member, so the Job aborts with that sentence and holds no GPU.
"""

from __future__ import annotations


class ImageError(Exception):
    """A runtime image cannot be made ready; ``str()`` says which, why and what to do."""


class ImageNotFound(ImageError):
    """The registry has no such repository, manifest or blob."""


class RegistryAuthRefused(ImageError):
    """The registry wants credentials the Node does not hold, or refused those it sent."""


class RegistryUnreachable(ImageError):
    """The registry could not be reached, or went away mid-pull too many times in a row."""


class RegistryFailed(ImageError):
    """The registry answered, but with an HTTP status a pull cannot go on from."""


class RegistryBusy(RegistryFailed):
    """The registry answered 429 or a 5xx that it may recover from: retried, with the pause it
    asks for (``retry_after_s``, from ``Retry-After``) when it names one."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ManifestRefused(ImageError):
    """The manifest (or image index, or config) is too large, malformed, of a media type
    TunePlane does not run, or has no manifest for this Node's platform."""


class DigestMismatch(ImageError):
    """A manifest or blob's bytes do not hash to the digest (or the size) that names it."""


class ImageRefused(ImageError):
    """A layer of the image cannot be unpacked safely (see ``image_layer.LayerRefused``)."""
