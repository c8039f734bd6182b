"""``tuneplane-node doctor``'s image cache lines: the cache's integrity and its free space.

Rules: doctor only reads here (nothing is repaired or removed; each line names the command that
fixes it). Every record's root must exist; blobs are re-hashed against their digest, all of
them up to :data:`HASH_BUDGET_BYTES` (then a random sample up to that budget, and the line says
how many were checked), or all with ``--check-all-blobs``. Partial downloads untouched for a day
and build folders no pull holds are reported as left behind.
"""

from __future__ import annotations

import hashlib
import random
import shutil
import time
from pathlib import Path

from .doctor import disk_finding
from .image_store import DEFAULT_PARTIAL_AGE_S, CacheContents, scan
from .sizes import human_bytes
from .workload_checks import Finding

#: Bytes of blobs doctor re-hashes by default (about 2 s of SHA-256 on one core per GiB).
HASH_BUDGET_BYTES = 2 * 2**30
_CHUNK = 1 << 20


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _users(contents: CacheContents, blob_hex: str) -> str:
    refs = [i.ref for i in contents.images if blob_hex in i.blobs]
    return ", ".join(refs) if refs else "no image"


def blob_findings(
    contents: CacheContents, budget: int | None, seed: int | None = None
) -> list[Finding]:
    """Re-hash blobs: all when ``budget`` is None or they fit in it, else a random sample."""
    folder = contents.directory / "blobs" / "sha256"
    names = sorted(contents.blobs)
    total = sum(contents.blobs.values())
    chosen = names
    if budget is not None and total > budget:
        random.Random(seed).shuffle(chosen := list(names))
        picked: list[str] = []
        spent = 0
        for name in chosen:
            if spent + contents.blobs[name] > budget and picked:
                continue
            picked.append(name)
            spent += contents.blobs[name]
        chosen = picked
    findings: list[Finding] = []
    checked = 0
    for name in chosen:
        try:
            actual = file_sha256(folder / name)
        except FileNotFoundError:
            continue  # removed since the scan
        except OSError as exc:
            findings.append(
                Finding("FAIL", f"image cache blob sha256:{name} cannot be read: {exc}")
            )
            continue
        checked += 1
        if actual != name:
            findings.append(
                Finding(
                    "FAIL",
                    f"image cache blob sha256:{name} is corrupt: its bytes hash to sha256:{actual} "
                    f"(used by {_users(contents, name)}); remove those images with `tuneplane-node "
                    "images rm` (their next Prepare pulls them again), or delete "
                    f"{folder / name} and run `tuneplane-node images prune`",
                )
            )
    how = (
        "all"
        if len(chosen) == len(names)
        else f"a random sample of {len(chosen)} of {len(names)} (doctor's "
        f"{human_bytes(budget or 0)} budget; --check-all-blobs checks every one)"
    )
    if not findings:
        findings.append(
            Finding(
                "ok",
                f"image cache blobs: {checked} of {len(names)} match their digests ({how} "
                "re-hashed)",
            )
        )
    elif len(chosen) != len(names):
        findings.append(Finding("warn", f"image cache blobs: only {how} were re-hashed"))
    return findings


def integrity_findings(
    directory: Path, budget: int | None = HASH_BUDGET_BYTES, now: float | None = None
) -> list[Finding]:
    """The cache's records, roots, blobs and what crashes left behind."""
    if not directory.exists():
        return [Finding("ok", f"image cache {directory}: empty (no image pulled yet)")]
    contents = scan(directory)
    findings: list[Finding] = []
    for image in contents.images:
        if not image.root_present:
            findings.append(
                Finding(
                    "FAIL",
                    f"image cache: {image.ref} has a record but its root "
                    f"{directory / 'roots' / image.digest_hex} is missing, so members cannot "
                    f"run in it; run `tuneplane-node images rm sha256:{image.digest_hex}` and "
                    "its next Prepare pulls it again",
                )
            )
    findings.extend(blob_findings(contents, budget))
    at = time.time() if now is None else now
    stale = {
        h: b
        for h, (b, mtime) in contents.partials.items()
        if at - mtime >= DEFAULT_PARTIAL_AGE_S and h not in contents.busy
    }
    builds = {n: b for n, b in contents.builds.items() if n.split("-")[1] not in contents.busy}
    left = {**contents.orphan_roots}
    if stale or builds or left:
        findings.append(
            Finding(
                "warn",
                f"image cache: left behind {len(stale)} partial downloads untouched for a day "
                f"({human_bytes(sum(stale.values()))}), {len(builds)} build folders no pull "
                f"holds ({human_bytes(sum(builds.values()))}), {len(left)} roots without a "
                f"record ({human_bytes(sum(left.values()))}); `tuneplane-node images prune` "
                "removes them",
            )
        )
    findings.append(
        Finding(
            "ok",
            f"image cache {directory}: {len(contents.images)} images, "
            f"{human_bytes(contents.total_bytes)} on disk",
        )
    )
    return findings


def space_finding(directory: Path, max_bytes: int | None, held: int) -> Finding:
    """Free space on the cache's file system: doctor's usual thresholds, and a warning when the
    size limit lets the cache grow past the free space (pulls would fail with a full disk)."""
    where = directory if directory.exists() else directory.parent
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        usage = shutil.disk_usage(where)
    except OSError as exc:
        return Finding(
            "FAIL", f"disk space under the image cache {directory} cannot be read: {exc}"
        )
    found = disk_finding("image cache", directory, usage.free, usage.total)
    if found.level == "ok" and max_bytes is not None and max_bytes - held > usage.free:
        return Finding(
            "warn",
            f"{found.text}; [images] max_size ({human_bytes(max_bytes)}) lets the cache grow by "
            f"{human_bytes(max_bytes - held)}, more than is free: lower max_size or free space, "
            "or pulls will fail with a full disk",
        )
    return found


def cache_findings(
    directory: Path, max_bytes: int | None, budget: int | None = HASH_BUDGET_BYTES
) -> list[Finding]:
    """Everything doctor says about the image cache."""
    found = integrity_findings(directory, budget)
    held = scan(directory).total_bytes if directory.exists() else 0
    return [*found, space_finding(directory, max_bytes, held)]
