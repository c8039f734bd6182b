"""``tuneplane-node images ls|rm|prune``: the operator's view of the runtime image cache
(``image_root``: ``tuneplane-images`` beside the state directory unless set) and its removals.

Rules: ``ls`` only reads. ``rm`` and ``prune`` wait for the pulls in progress (the cache's lock,
agent/image_store.py), never remove an image a live member uses (the journal, read-only), and
say what they removed and the bytes freed; ``--dry-run`` says what would go and removes
nothing. ``--json`` prints what a script reads; the plain form a table. Works with the agent
running or stopped.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from .cli_settings import images_settings
from .cli_support import duration_s, image_root_option, ms_text, sentences, state_dir_option
from .image_removal import (
    OutsideCache,
    Removed,
    busy_documents,
    carry_out,
)
from .image_removal_plan import (
    Removal,
    plan_eviction,
    plan_prune,
    plan_removal,
)
from .image_store import (
    DEFAULT_PARTIAL_AGE_S,
    CacheContents,
    CacheRefused,
    cache_directory,
    removing,
    scan,
)
from .image_usage import ImageUsage, read_usage
from .sizes import human_bytes
from .state_dir import StateDir


@click.group("images")
def images_group() -> None:
    """The runtime image cache: list, remove and prune images (removals wait for pulls)."""


@contextmanager
def _refusals() -> Iterator[None]:
    with sentences():
        try:
            yield
        except (CacheRefused, OutsideCache) as exc:
            raise click.ClickException(str(exc)) from None


def _usage(state_dir: Path) -> ImageUsage:
    return read_usage(StateDir(state_dir).journal_path)


def _wait_note() -> None:
    click.echo(
        "waiting for the image pulls in progress to finish before removing anything (Ctrl-C "
        "stops; nothing has been removed)",
        err=True,
    )


def _rows(contents: CacheContents, usage: ImageUsage) -> list[dict[str, Any]]:
    return [
        {
            "image": image.ref,
            "digest": f"sha256:{image.digest_hex}",
            "manifest": image.manifest,
            "bytes": contents.image_bytes(image),
            "root_bytes": image.root_bytes,
            "root_present": image.root_present,
            "layers": image.layers,
            "last_used_ms": image.used_at_ms,
            "in_use_by": [str(k) for k in usage.users(image.digest_hex)],
        }
        for image in contents.images
    ]


def _summary(contents: CacheContents, limit: int | None) -> dict[str, Any]:
    return {
        "directory": str(contents.directory),
        "images": len(contents.images),
        "bytes": contents.total_bytes,
        "blob_bytes": sum(contents.blobs.values()),
        "root_bytes": sum(i.root_bytes for i in contents.images),
        "partial_bytes": sum(b for b, _ in contents.partials.values()),
        "left_behind_bytes": sum(contents.orphan_roots.values()) + sum(contents.builds.values()),
        "max_bytes": limit,
    }


@images_group.command("ls")
@state_dir_option
@image_root_option
@click.option("--json", "as_json", is_flag=True)
def images_ls(state_dir: Path, image_root: Path | None, as_json: bool) -> None:
    """Every cached image: reference, manifest digest, size on disk, layers, last used, and the
    live members that use it."""
    with _refusals():
        directory = cache_directory(state_dir, image_root)
        contents = scan(directory)
        usage = _usage(state_dir)
        limit = images_settings()
    rows = _rows(contents, usage)
    summary = _summary(contents, limit)
    if as_json:
        click.echo(json.dumps({"images": rows, "cache": summary}, indent=2))
        return
    table = [
        [
            row["image"].removeprefix("image:"),
            row["manifest"][:19] + "…",
            human_bytes(row["bytes"]),
            str(row["layers"]),
            ms_text(row["last_used_ms"]),
            ", ".join(row["in_use_by"]) or "-",
        ]
        for row in rows
    ]
    if table:
        heads = ["IMAGE", "MANIFEST", "SIZE", "LAYERS", "LAST USED (UTC)", "IN USE BY"]
        widths = [max(len(h), *(len(r[i]) for r in table)) for i, h in enumerate(heads)]
        for cells in (heads, *table):
            click.echo("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip())
    else:
        click.echo(f"no images in the cache {directory}")
    limit_text = f"limit {human_bytes(limit)}" if limit is not None else "no size limit"
    click.echo(
        f"cache {directory}: {len(rows)} image{'s' * (len(rows) != 1)}, "
        f"{human_bytes(summary['bytes'])} on disk (blobs {human_bytes(summary['blob_bytes'])}, "
        f"roots {human_bytes(summary['root_bytes'])}, partial downloads "
        f"{human_bytes(summary['partial_bytes'])}, left behind by crashes "
        f"{human_bytes(summary['left_behind_bytes'])}); {limit_text}"
    )


def _removed_json(removed: Removed | Removal, dry_run: bool) -> dict[str, Any]:
    skipped = removed.skipped if isinstance(removed, Removed) else ()
    kept = removed.kept if isinstance(removed, Removal) else ()
    return {
        "dry_run": dry_run,
        "images": [f"sha256:{h}" for h in removed.images],
        "roots_without_record": list(removed.orphan_roots),
        "build_folders": list(removed.builds),
        "partial_downloads": list(removed.partials),
        "blobs": [f"sha256:{h}" for h in removed.blobs],
        "bytes_freed": removed.bytes,
        "skipped": list(skipped),
        "kept": list(kept),
    }


def _tell(removed: Removed | Removal, contents: CacheContents, dry_run: bool) -> None:
    verb = "would remove" if dry_run else "removed"
    refs = {i.digest_hex: i.ref for i in contents.images}
    for hex_ in removed.images:
        click.echo(f"{verb} image {refs.get(hex_, hex_)} (its record and root)")
    for hex_ in removed.orphan_roots:
        click.echo(f"{verb} root without a record roots/{hex_}")
    for name in removed.builds:
        click.echo(f"{verb} build folder left behind roots/{name}")
    for hex_ in removed.partials:
        click.echo(f"{verb} stale partial download partial/{hex_}")
    for hex_ in removed.blobs:
        click.echo(f"{verb} blob sha256:{hex_} (no remaining image refers to it)")
    if isinstance(removed, Removed):
        for sentence in removed.skipped:
            click.echo(f"skipped: {sentence}")
    counts = (
        f"{len(removed.images)} images, {len(removed.blobs)} blobs, "
        f"{len(removed.orphan_roots)} roots without a record, {len(removed.builds)} build "
        f"folders, {len(removed.partials)} partial downloads"
    )
    freed = "would free" if dry_run else "freed"
    click.echo(f"{verb} {counts}; {freed} {human_bytes(removed.bytes)}")


@images_group.command("rm")
@click.argument("image")
@state_dir_option
@image_root_option
@click.option("--json", "as_json", is_flag=True)
def images_rm(image: str, state_dir: Path, image_root: Path | None, as_json: bool) -> None:
    """Remove one image (a reference, its digest, or 12+ hex digits of it) and the blobs only it
    uses. Refused while a live member uses it; there is no way to force that."""
    with _refusals():
        directory = cache_directory(state_dir, image_root)
        with removing(directory, on_wait=_wait_note):
            contents = scan(directory)
            plan = plan_removal(contents, _usage(state_dir), contents.find(image))
            removed = carry_out(directory, plan)
    if as_json:
        click.echo(json.dumps(_removed_json(removed, False), indent=2))
        return
    _tell(removed, contents, False)
    if not removed.images:
        raise click.ClickException(
            f"The image {image} was not removed: {'; '.join(removed.skipped)}."
        )


@images_group.command("prune")
@state_dir_option
@image_root_option
@click.option("--dry-run", is_flag=True, help="Say what would be removed; remove nothing.")
@click.option(
    "--partials-older-than",
    default=f"{DEFAULT_PARTIAL_AGE_S // 3600}h",
    show_default=True,
    help="Remove partial downloads untouched for this long (30m, 2h, 1d).",
)
@click.option("--json", "as_json", is_flag=True)
def images_prune(
    state_dir: Path,
    image_root: Path | None,
    dry_run: bool,
    partials_older_than: str,
    as_json: bool,
) -> None:
    """Remove what no cached image needs (blobs no image refers to, roots and build folders a
    crash left, stale partial downloads), then least recently used images while the cache is
    over node.toml's [images] max_size, never one a live member uses."""
    with _refusals():
        age = duration_s(partials_older_than)
        if age is None:
            raise click.BadParameter(
                f"{partials_older_than!r} is not a duration; give one like 30m, 2h or 1d.",
                param_hint="--partials-older-than",
            )
        directory = cache_directory(state_dir, image_root)
        limit = images_settings()
        with removing(directory, on_wait=_wait_note):
            contents = scan(directory)
            documents = busy_documents(contents)
            plan = plan_prune(contents, time.time(), age, documents)
            if limit is not None:
                plan = plan_eviction(
                    contents, _usage(state_dir), limit, busy_documents=documents, already=plan
                )
            removed: Removed | Removal = plan if dry_run else carry_out(directory, plan)
    if as_json:
        click.echo(
            json.dumps(_removed_json(removed, dry_run) | {"kept": list(plan.kept)}, indent=2)
        )
        return
    _tell(removed, contents, dry_run)
    for sentence in plan.kept:
        click.echo(f"kept: {sentence}")
