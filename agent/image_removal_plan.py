"""Deciding what the image cache removes, without touching it: ``images rm`` and ``prune``, and
the size limit's eviction, least recently used first (:mod:`.image_removal` carries it out).

Rules (the cache's, in :mod:`.image_store`): an image a live member uses is never planned for
removal, nor any image while a live member's runtime is unknown; a blob goes only when no image
that stays refers to it and no pull in progress may count on it. Pure: every input is read
before (:func:`.image_store.scan`, :func:`.image_removal.busy_documents`).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from .image_store import BUILD_NAME, CacheContents, CachedImage, CacheRefused
from .image_usage import ImageUsage
from .sizes import human_bytes


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
            if (m := BUILD_NAME.fullmatch(name)) and m[1] not in contents.busy
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
