"""The image cache's management on real files: images pulled from a real registry over loopback
TLS, members written through the real journal, and the real ``tuneplane-node images`` and
``doctor`` processes. Every path the cache or a command touches is under the test's tmp_path."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from tests.support.oci_registry import LAYER_TAR, RegistryProcess, start_registry, tar_layer
from tuneplane.agent.adapter import open_aio_host
from tuneplane.agent.atomic_file import write_atomic
from tuneplane.agent.image_cache import CacheLimit, ImageCache, PullProgress
from tuneplane.agent.image_pull import RegistryAccess
from tuneplane.agent.image_ref import ImageRef, parse_image_ref
from tuneplane.agent.image_store import default_image_root, mark_used, scan
from tuneplane.agent.image_usage import read_usage
from tuneplane.agent.journal import Journal
from tuneplane.agent.journal_records import MemberKey, NewMember
from tuneplane.agent.member_state import MemberEvent
from tuneplane.proto.contract import jobspec

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[RegistryProcess]:
    with start_registry(tmp_path / "registry") as reg:
        yield reg


def _state(tmp_path: Path) -> Path:
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    return state


def _cache(
    tmp_path: Path, registry: RegistryProcess, limit: CacheLimit | None = None
) -> ImageCache:
    return ImageCache(
        default_image_root(_state(tmp_path)),
        {registry.address: RegistryAccess(ca_file=registry.ca_file)},
        client_options={"first_pause": 0.05, "retries": 40},
        limit=limit,
    )


def _push(registry: RegistryProcess, name: str, *layers: list[tuple[str, bytes]]) -> ImageRef:
    pushed = registry.push_image(name, [tar_layer(entries) for entries in layers])
    return parse_image_ref(pushed.ref_text(registry.address))


BASE = [("etc/os-release", b"ID=shared\n"), ("usr/lib/base.so", b"\x7fELF" + b"b" * 4000)]


def node_cli(*args: str, config: Path | None = None) -> subprocess.CompletedProcess[str]:
    pre = ["--config", str(config)] if config else []
    return subprocess.run(
        [sys.executable, "-m", "tuneplane.agent.cli", *pre, *args],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "TUNEPLANE_NODE_CONFIG": ""},
    )  # fmt: skip


def _spec_json(runtime_id: str) -> str:
    spec = jobspec.JobSpec(
        api_version=jobspec.API_VERSION, project="p", experiment="e", method_id="custom/custom",
        recipe_digest="sha256:0", runtime_id=runtime_id, entrypoint=("python3", "train.py"),
        resources=jobspec.Resources(profile="h200", series="h200", gpus=1), grace_period_s=2,
    )  # fmt: skip
    return jobspec.canonical_json(spec)


async def _add_member(state: Path, key: MemberKey, runtime_id: str | None) -> None:
    """A member in ``preparing`` through the real journal API, with the JobSpec its Prepare
    writes (``runtime_id`` None: not written yet)."""
    member_dir = state / "members" / str(key)
    member_dir.mkdir(parents=True)
    if runtime_id is not None:
        write_atomic(member_dir / "jobspec.json", _spec_json(runtime_id).encode())
    async with open_aio_host():
        journal = await Journal.open(state / "journal.db")
        try:
            await journal.create_member(
                NewMember(key, 1, (0,), str(member_dir), str(state / "out" / str(key)), 2), 1
            )
        finally:
            await journal.close()


async def _move(state: Path, key: MemberKey, event: MemberEvent) -> None:
    async with open_aio_host():
        journal = await Journal.open(state / "journal.db")
        try:
            await journal.transition(key, event, int(time.time() * 1000), reason="test")
        finally:
            await journal.close()


def _snapshot(folder: Path) -> dict[str, str]:
    """Every entry under ``folder`` (links not followed) with its content hash or link target."""
    found: dict[str, str] = {}
    for where, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(where, name)
            rel = str(path.relative_to(folder))
            if path.is_symlink():
                found[rel] = "-> " + os.readlink(path)
            elif path.is_file():
                found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                found[rel] = "dir"
    return found


def _blob_names(cache: Path) -> set[str]:
    return {p.name for p in (cache / "blobs" / "sha256").iterdir()}


async def test_ls_shows_each_image_its_size_layers_and_users(
    tmp_path: Path, registry: RegistryProcess
) -> None:
    state = _state(tmp_path)
    cache = _cache(tmp_path, registry)
    one = _push(registry, "team/one", BASE, [("app/one.py", b"print(1)\n")])
    two = _push(registry, "team/two", BASE, [("app/two.py", b"print(2)\n" * 3000)])
    await cache.ensure(one)
    await cache.ensure(two)
    user = MemberKey("run-a", 1, 0)
    await _add_member(state, user, str(two))
    await _add_member(state, MemberKey("run-host", 1, 0), "host:bash")

    done = node_cli("images", "ls", "--state-dir", str(state), "--json")
    assert done.returncode == 0, done.stderr
    listed = json.loads(done.stdout)
    rows = {row["image"]: row for row in listed["images"]}
    assert set(rows) == {str(one), str(two)}
    assert rows[str(two)]["in_use_by"] == [str(user)] and rows[str(one)]["in_use_by"] == []
    for ref in (one, two):
        row = rows[str(ref)]
        assert row["digest"] == ref.digest and row["layers"] == 2 and row["root_present"]
        record = json.loads(
            (default_image_root(state) / "images" / f"{ref.digest_hex}.json").read_text()
        )
        assert row["manifest"] == record["manifest"]
        # Its root (at least the files' bytes) plus its blobs.
        assert row["bytes"] > record["bytes"] and row["last_used_ms"] > 0
    assert listed["cache"]["bytes"] == scan(default_image_root(state)).total_bytes
    # Two is newer (used last): listed first in the table, with its user.
    table = node_cli("images", "ls", "--state-dir", str(state))
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:3] == ["IMAGE", "MANIFEST", "SIZE"]
    assert lines[1].startswith(str(two).removeprefix("image:")) and lines[1].endswith(str(user))
    assert lines[2].startswith(str(one).removeprefix("image:")) and lines[2].endswith("-")
    assert lines[3].startswith(f"cache {default_image_root(state)}: 2 images")


async def test_rm_is_refused_while_a_live_member_uses_the_image_and_changes_nothing(
    tmp_path: Path, registry: RegistryProcess
) -> None:
    state = _state(tmp_path)
    cache = _cache(tmp_path, registry)
    one = _push(registry, "team/one", BASE, [("app/one.py", b"print(1)\n")])
    two = _push(registry, "team/two", BASE, [("app/two.py", b"print(2)\n")])
    await cache.ensure(one)
    await cache.ensure(two)
    user = MemberKey("run-a", 1, 0)
    await _add_member(state, user, str(one))
    before = _snapshot(default_image_root(state))

    refused = node_cli("images", "rm", str(one), "--state-dir", str(state))
    assert refused.returncode == 1
    assert f"The image {one} is used by live member {user}" in refused.stderr
    assert "cannot be removed while a member uses it" in refused.stderr
    assert _snapshot(default_image_root(state)) == before
    # There is no force.
    forced = node_cli("images", "rm", "--force", str(one), "--state-dir", str(state))
    assert forced.returncode == 2 and _snapshot(default_image_root(state)) == before

    # Once the member has ended, rm removes the record, the root and the blobs only it used;
    # the layer it shared with two stays.
    await _move(state, user, MemberEvent.PREPARE_FAILED)
    done = node_cli("images", "rm", one.digest_hex[:12], "--state-dir", str(state), "--json")
    assert done.returncode == 0, done.stderr
    removed = json.loads(done.stdout)
    assert removed["images"] == [one.digest]
    images = default_image_root(state)
    assert not (images / "roots" / one.digest_hex).exists()
    assert not (images / "images" / f"{one.digest_hex}.json").exists()
    left = scan(images)
    assert [i.digest_hex for i in left.images] == [two.digest_hex]
    (kept,) = left.images
    assert _blob_names(images) == set(kept.blobs)
    assert {b.removeprefix("sha256:") for b in removed["blobs"]} == (
        set(before_blobs(before)) - set(kept.blobs)
    )
    freed = removed["bytes_freed"]
    assert freed > 0 and cache.ready(two) is not None


def before_blobs(snapshot: dict[str, str]) -> list[str]:
    return [k.rsplit("/", 1)[1] for k in snapshot if k.startswith("blobs/sha256/")]


async def test_rm_is_refused_while_a_live_members_runtime_is_not_known(
    tmp_path: Path, registry: RegistryProcess
) -> None:
    state = _state(tmp_path)
    one = _push(registry, "team/one", BASE)
    await _cache(tmp_path, registry).ensure(one)
    await _add_member(state, MemberKey("run-p", 1, 0), None)  # Prepare has not written it yet
    before = _snapshot(default_image_root(state))
    refused = node_cli("images", "rm", str(one), "--state-dir", str(state))
    assert refused.returncode == 1 and "its runtime is not on disk yet" in refused.stderr
    assert _snapshot(default_image_root(state)) == before


async def test_prune_removes_exactly_what_no_image_needs_and_nothing_outside(
    tmp_path: Path, registry: RegistryProcess
) -> None:
    state = _state(tmp_path)
    one = _push(registry, "team/one", BASE, [("app/one.py", b"print(1)\n")])
    await _cache(tmp_path, registry).ensure(one)
    images = default_image_root(state)
    needed = _blob_names(images)
    # A blob no image refers to (verified bytes, named by their digest), a root without a
    # record and a build folder a crash left, a stale and a fresh partial download, and links
    # named like a blob and a root that lead out of the cache.
    stray = b"an old layer nobody uses\n"
    stray_hex = hashlib.sha256(stray).hexdigest()
    (images / "blobs" / "sha256" / stray_hex).write_bytes(stray)
    orphan = images / "roots" / ("a" * 64)
    (orphan / "usr").mkdir(parents=True)
    (orphan / "usr" / "file").write_bytes(b"x" * 5000)
    os.chmod(orphan / "usr", 0o555)  # read-only folders, as images have
    build = images / "roots" / f".build-{'b' * 64}-123-cafe"
    build.mkdir()
    (build / "half").write_bytes(b"y" * 3000)
    (images / "partial").mkdir(exist_ok=True)
    stale, fresh = images / "partial" / ("c" * 64), images / "partial" / ("d" * 64)
    stale.write_bytes(b"z" * 7000)
    fresh.write_bytes(b"w" * 100)
    two_days_ago = time.time() - 2 * 86400
    os.utime(stale, (two_days_ago, two_days_ago))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"keep me")
    link_hex = "e" * 64
    os.symlink(outside, images / "blobs" / "sha256" / link_hex)
    os.symlink(outside / "precious", images / "roots" / ("f" * 64))

    before = _snapshot(images)
    dry = node_cli("images", "prune", "--dry-run", "--state-dir", str(state))
    assert dry.returncode == 0, dry.stderr
    assert _snapshot(images) == before
    assert f"would remove blob sha256:{stray_hex}" in dry.stdout
    assert "would remove 0 images, 1 blobs, 1 roots without a record, 1 build folders, 1 " \
           "partial downloads" in dry.stdout  # fmt: skip

    done = node_cli("images", "prune", "--state-dir", str(state), "--json")
    assert done.returncode == 0, done.stderr
    removed = json.loads(done.stdout)
    assert removed["blobs"] == [f"sha256:{stray_hex}"]
    assert removed["roots_without_record"] == ["a" * 64]
    assert removed["build_folders"] == [build.name]
    assert removed["partial_downloads"] == ["c" * 64]
    assert removed["images"] == [] and removed["bytes_freed"] >= 7000 + 5000 + 3000
    # The image, its blobs and the fresh partial stay; links are never followed nor counted
    # as cache entries: they and their targets stay.
    assert _blob_names(images) == needed | {link_hex}
    assert (images / "roots" / ("f" * 64)).is_symlink()
    assert not orphan.exists() and not build.exists() and not stale.exists() and fresh.exists()
    assert (outside / "precious").read_bytes() == b"keep me"
    assert _cache(tmp_path, registry).ready(one) is not None


async def test_a_cache_folder_that_is_a_link_out_of_the_cache_is_refused(
    tmp_path: Path, registry: RegistryProcess
) -> None:
    state = _state(tmp_path)
    images = default_image_root(state)
    outside = tmp_path / "outside"
    (outside / ("a" * 64)).mkdir(parents=True)
    (outside / ("a" * 64) / "precious").write_bytes(b"keep me")
    images.mkdir()
    os.symlink(outside, images / "roots")  # roots/ leads out of the cache
    done = node_cli("images", "prune", "--state-dir", str(state))
    assert done.returncode == 1
    assert "outside the image cache; nothing was removed there" in done.stderr
    assert (outside / ("a" * 64) / "precious").read_bytes() == b"keep me"


async def test_eviction_keeps_the_limit_and_never_evicts_an_image_in_use(
    tmp_path: Path, registry: RegistryProcess, caplog: pytest.LogCaptureFixture
) -> None:
    state = _state(tmp_path)
    images = default_image_root(state)
    big = [os.urandom(256 << 10) for _ in range(4)]  # incompressible: 256 KiB per image
    refs = [_push(registry, f"team/img{i}", [(f"data/{i}.bin", big[i])]) for i in range(4)]
    # Without a limit, three images; the oldest (0) is in use by a live member.
    plain = _cache(tmp_path, registry)
    for i, ref in enumerate(refs[:3]):
        await plain.ensure(ref)
        mark_used(images, ref.digest_hex, 1_000 + i)
    await _add_member(state, MemberKey("run-a", 1, 0), str(refs[0]))
    one_image = max(scan(images).image_bytes(i) for i in scan(images).images)
    limit = 3 * one_image - one_image // 2  # room for two and a half images
    cache = _cache(tmp_path, registry, CacheLimit(limit, lambda: read_usage(state / "journal.db")))
    await cache.ensure(refs[3])
    left = scan(images)
    # 1 and then 2 were the least recently used images no member uses; 0 is in use, 3 was
    # just pulled for a member.
    assert {i.digest_hex for i in left.images} == {refs[0].digest_hex, refs[3].digest_hex}
    assert left.total_bytes <= limit
    assert not (images / "roots" / refs[1].digest_hex).exists()
    assert set(left.blobs) == set().union(*(i.blobs for i in left.images))

    # A limit nothing can meet (everything left is in use, or just pulled): logged with a
    # sentence, and the pull still answers.
    for ref in refs:
        if cache.ready(ref) is not None and ref != refs[0]:
            await _add_member(state, MemberKey(f"run-{ref.digest_hex[:6]}", 1, 0), str(ref))
    tight = _cache(tmp_path, registry, CacheLimit(1, lambda: read_usage(state / "journal.db")))
    caplog.set_level(logging.INFO, logger="tuneplane.agent.image_cache")
    ready = await tight.ensure(refs[1])
    assert (ready.root / "data" / "1.bin").read_bytes() == big[1]
    over = [r.getMessage() for r in caplog.records if "over its limit" in r.getMessage()]
    assert over and "is used by member run-a.1.0" in over[0]
    assert {i.digest_hex for i in scan(images).images} >= {refs[0].digest_hex, refs[1].digest_hex}


async def test_prune_waits_for_a_pull_in_progress_and_does_not_disturb_it(
    tmp_path: Path, registry: RegistryProcess
) -> None:
    state = _state(tmp_path)
    images = default_image_root(state)
    # An image already there that no image refers to any more: what prune would remove.
    old = _push(registry, "team/old", [("old.txt", b"old\n")])
    await _cache(tmp_path, registry).ensure(old)
    content = os.urandom(24 << 20)
    layer = tar_layer([("big.bin", content)], gzipped=False)
    pushed = registry.push_image("team/big", [layer], layer_type=LAYER_TAR)
    ref = parse_image_ref(pushed.ref_text(registry.address))
    cache = _cache(tmp_path, registry)
    started = trio.Event()
    killed = False

    def progress(p: PullProgress) -> None:
        nonlocal killed
        # Stall the pull mid-blob (the registry dies) so prune surely runs beside it.
        if not killed and p.bytes_done >= len(pushed.config) + (2 << 20):
            registry.kill()
            killed = True
            started.set()

    outcome: list[subprocess.CompletedProcess[str]] = []

    async def prune_beside() -> None:
        await started.wait()
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "tuneplane.agent.cli", "images", "prune", "--state-dir",
             str(state), "--partials-older-than", "0s", "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        # It waits (and says so) while the pull holds the cache: nothing is removed meanwhile.
        assert proc.stderr is not None and proc.stdout is not None
        note = await proc.stderr.receive_some(4096)
        assert b"waiting for the image pulls in progress" in note
        assert (images / "partial" / layer_hex).exists()
        await trio.to_thread.run_sync(registry.start)
        out = b""
        while chunk := await proc.stdout.receive_some(65536):
            out += chunk
        code = await proc.wait()
        outcome.append(subprocess.CompletedProcess([], code, out.decode(), ""))

    layer_hex = hashlib.sha256(layer).hexdigest()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(prune_beside)
        ready = await cache.ensure(ref, progress)
    assert (ready.root / "big.bin").read_bytes() == content
    (done,) = outcome
    assert done.returncode == 0
    removed = json.loads(done.stdout)
    # Prune ran after the pull: it kept every blob the new image needs, and its partial was
    # already renamed into blobs/ (none left to remove).
    assert layer_hex in _blob_names(images) and removed["partial_downloads"] == []
    assert removed["blobs"] == [] and removed["images"] == []
    assert cache.ready(ref) is not None and cache.ready(old) is not None


async def test_doctor_finds_a_corrupt_blob_and_a_missing_root(
    tmp_path: Path, registry: RegistryProcess
) -> None:
    state = _state(tmp_path)
    images = default_image_root(state)
    one = _push(registry, "team/one", BASE, [("app/one.py", b"print(1)\n" * 100)])
    two = _push(registry, "team/two", [("two.txt", b"two\n")])
    await _cache(tmp_path, registry).ensure(one)
    await _cache(tmp_path, registry).ensure(two)
    healthy = node_cli("doctor", "--state-dir", str(state))
    assert "ok    image cache blobs: 7 of 7 match their digests (all re-hashed)" in healthy.stdout
    record = json.loads((images / "images" / f"{one.digest_hex}.json").read_text())
    layer_hex = record["layers"][1]["digest"].removeprefix("sha256:")
    blob = images / "blobs" / "sha256" / layer_hex
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte flipped
    blob.write_bytes(bytes(data))
    root = images / "roots" / two.digest_hex
    os.rename(root, tmp_path / "moved-root")

    done = node_cli("doctor", "--state-dir", str(state))
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    (corrupt,) = [line for line in lines if "is corrupt" in line]
    assert corrupt.startswith("FAIL  image cache blob sha256:" + layer_hex)
    assert f"its bytes hash to sha256:{hashlib.sha256(bytes(data)).hexdigest()}" in corrupt
    assert f"used by {one}" in corrupt
    (missing,) = [line for line in lines if "its root" in line]
    assert missing.startswith(f"FAIL  image cache: {two} has a record but its root {root}")
    space = [line for line in lines if "disk space under the image cache" in line]
    assert len(space) == 1 and space[0].split()[0] in ("ok", "warn")


def test_max_size_is_read_in_bytes_or_with_a_unit_and_a_typo_is_a_sentence(
    tmp_path: Path,
) -> None:
    from tuneplane.agent import config as node_config

    good = tmp_path / "node.toml"
    good.write_text('[images]\nmax_size = "50GiB"\n')
    assert node_config.images_settings(node_config.load(good)).max_bytes == 50 * 2**30
    good.write_text("[images]\nmax_size = 1000000\n")
    assert node_config.images_settings(node_config.load(good)).max_bytes == 10**6
    good.write_text('[images]\nmax_size = "1.5 GB"\n')
    assert node_config.images_settings(node_config.load(good)).max_bytes == 1_500_000_000
    bad = tmp_path / "bad.toml"
    bad.write_text('[images]\nmax_size = "50 parsecs"\n')
    with pytest.raises(node_config.NodeConfigError, match=r"'images.max_size': '50 parsecs' is"):
        node_config.load(bad)
    bad.write_text('[images]\nmax_sise = "50GiB"\n')
    with pytest.raises(node_config.NodeConfigError, match=r"unknown key 'images\.max_sise'"):
        node_config.load(bad)
    # `images prune` reads the limit from node.toml (and state_dir with it).
    good.write_text(f'state_dir = "{tmp_path / "state"}"\n[images]\nmax_size = "1GiB"\n')
    done = node_cli("images", "ls", config=good)
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().endswith("; limit 1.0 GiB")
    # ... and the cache where `run` keeps it: image_root when node.toml sets one, else
    # tuneplane-images beside the state dir.
    assert f"cache {tmp_path / 'tuneplane-images'}:" in done.stdout
    elsewhere = tmp_path / "elsewhere"
    good.write_text(f'state_dir = "{tmp_path / "state"}"\nimage_root = "{elsewhere}"\n')
    done = node_cli("images", "ls", config=good)
    assert done.returncode == 0, done.stderr
    assert f"cache {elsewhere}:" in done.stdout
