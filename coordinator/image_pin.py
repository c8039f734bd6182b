"""Runtime images at Preview: an ``image:`` runtime is checked against its Fleet's registries
and pinned to the digest its registry serves now, so the resolved JobSpec (and so its digest)
names the exact image, and a retag never changes a Job.

Rules:
- A ``host:`` runtime passes untouched. An ``image:`` runtime is ``<registry>/<name>:<tag>`` or
  ``<registry>/<name>@sha256:<hex>`` (:mod:`tuneplane.agent.image_ref`), from the JobSpec or the
  recipe; its registry must be one ``[fleet.<name>.registries]`` lists for the Profile's Fleet.
  Both checks are pure (:func:`image_runtime`, :func:`registry_for`) and run in admission, before
  any network I/O.
- Then the registry is asked, once per Preview (:func:`pin`): a tag becomes the digest of the
  manifest or image index it names now (an index stays an index: the Node picks its platform at
  Prepare); a digest is checked to exist, so a Job never waits for GPUs only to abort at Prepare.
  Nothing is cached: each Preview asks again.
- The lookup is an await on the socket, never a blocked event loop (the TLS context is built in
  a worker thread), and it has a deadline, the registry's ``timeout_s``: a slow registry delays
  only the Previews that name it. Every failure is a :class:`RuntimeImageRefused` naming the
  registry, what happened and the fix; the password is read from its file for each lookup and
  never appears in a sentence or the log.
"""

from __future__ import annotations

import anyio
import attrs

from tuneplane.agent.image_errors import ImageError
from tuneplane.agent.image_pull import RegistryAccess, RegistryClient
from tuneplane.agent.image_ref import (
    EXAMPLE,
    PREFIX,
    ImageRef,
    ImageRefError,
    TaggedImage,
    parse_image_ref,
    parse_tagged_image,
)
from tuneplane.proto.contract.jobspec import JobSpecError

from .config import FleetSettings, RegistrySettings


class RuntimeImageRefused(Exception):
    """The runtime image cannot be pinned at Preview; ``str()`` names the image, the registry,
    what happened and the fix. Nothing is stored."""


@attrs.frozen
class Pinned:
    """An image runtime as Preview pinned it: the ``image:…@sha256:…`` the resolved JobSpec
    names, the tag it was resolved from ("" when the JobSpec pinned it already), and the media
    type of the manifest (or index) the digest names."""

    runtime_id: str
    tag: str
    media_type: str


def image_runtime(runtime_id: str) -> ImageRef | TaggedImage | None:
    """The image a resolved ``runtime_id`` names (None for a ``host:`` runtime), or the
    :class:`JobSpecError` on ``runtime_id`` saying why it is not one."""
    if not runtime_id.startswith(PREFIX):
        return None
    body = runtime_id.removeprefix(PREFIX)
    try:
        return parse_image_ref(runtime_id) if "@" in body else parse_tagged_image(body)
    except ImageRefError as exc:
        raise JobSpecError(
            "runtime_id",
            runtime_id,
            f"is not an image TunePlane can run ({exc})",
            f"Write image:<registry>/<name>:<tag> or {EXAMPLE}.",
        ) from None


def registry_for(
    image: ImageRef | TaggedImage, runtime_id: str, fleet: str, settings: FleetSettings | None
) -> RegistrySettings:
    """The Fleet's entry for the image's registry, or the :class:`JobSpecError` naming the
    runtime, the Fleet (which ``resources.profile`` chose) and how to fix it."""
    registries = settings.registries if settings is not None else {}
    found = registries.get(image.registry)
    if found is not None:
        return found
    listed = ", ".join(sorted(registries)) or "none"
    raise JobSpecError(
        "runtime_id",
        runtime_id,
        f"comes from the registry {image.registry}, which the Fleet {fleet!r} (chosen by "
        f"resources.profile) does not list (it lists: {listed})",
        f"Use an image from a registry the Fleet lists, pick a Profile on another Fleet, or ask "
        f'the coordinator\'s operator to add [fleet.{fleet}.registries."{image.registry}"] '
        "to coordinator.toml.",
    )


def _entry(fleet: str, registry: str) -> str:
    return f'[fleet.{fleet}.registries."{registry}"] of coordinator.toml'


def _read_password(settings: RegistrySettings, fleet: str) -> str | None:
    """The password ``password_file`` holds (one line; the trailing newline is not part of it)."""
    if settings.password_file is None:
        return None
    try:
        text = settings.password_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RuntimeImageRefused(
            f"The coordinator cannot read the password file {settings.password_file} of "
            f"{_entry(fleet, settings.registry)} ({type(exc).__name__}: "
            f"{getattr(exc, 'strerror', None) or exc}); ask the coordinator's operator to make "
            "it readable by the coordinator's account, then preview again."
        ) from None
    return text.rstrip("\r\n")


async def pin(
    image: ImageRef | TaggedImage, settings: RegistrySettings, fleet: str, runtime_id: str
) -> Pinned:
    """Ask the registry what ``image`` is now, within ``settings.timeout_s``. Raises
    :class:`RuntimeImageRefused`."""
    reference = image.tag if isinstance(image, TaggedImage) else image.digest
    what = "resolve the tag of" if isinstance(image, TaggedImage) else "find"
    deadline = settings.timeout_s
    try:
        with anyio.fail_after(deadline):
            password = await anyio.to_thread.run_sync(_read_password, settings, fleet)
            access = RegistryAccess(settings.ca_file, settings.username, password)
            # The TLS context loads CA bundles from disk: built off the event loop.
            client = await anyio.to_thread.run_sync(
                _client, image.registry, access, fleet, deadline
            )
            async with client:
                found = await client.resolve(image.name, reference)
    except TimeoutError:
        raise RuntimeImageRefused(
            f"Preview could not {what} the runtime {runtime_id}: the registry {image.registry} "
            f"did not answer within {deadline:g} s (timeout_s of {_entry(fleet, image.registry)}"
            "); check that it is up and reachable from the coordinator, then preview again."
        ) from None
    except ImageError as exc:
        raise RuntimeImageRefused(
            f"Preview could not {what} the runtime {runtime_id}: {exc}"
        ) from None
    if isinstance(image, TaggedImage):
        return Pinned(str(image.pinned(found.digest_hex)), image.tag, found.media_type)
    # resolve() has checked that the bytes served for the digest hash to it.
    return Pinned(str(image), "", found.media_type)


def _client(registry: str, access: RegistryAccess, fleet: str, timeout: float) -> RegistryClient:
    return RegistryClient(
        registry,
        access,
        timeout=timeout,
        retries=0,
        holder="coordinator",
        configured_in=_entry(fleet, registry),
    )
