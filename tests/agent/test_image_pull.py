"""Runtime images pulled from a real Distribution registry over loopback TLS into a real cache:
the files as the image has them, typed errors with sentences, and a pull that survives the
registry being SIGKILLed mid-blob. Every path written is under the test's tmp_path."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from tests.support.busy_proxy import busy_proxy
from tests.support.oci_registry import LAYER_TAR, RegistryProcess, start_registry, tar_layer
from tuneplane.agent.image_cache import ImageCache, PullProgress
from tuneplane.agent.image_errors import (
    DigestMismatch,
    ImageNotFound,
    ImageRefused,
    RegistryAuthRefused,
    RegistryFailed,
)
from tuneplane.agent.image_manifest import ImageConfig
from tuneplane.agent.image_pull import MAX_PAUSE_S, RegistryAccess, retry_after, retry_pause
from tuneplane.agent.image_ref import ImageRef, parse_image_ref

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[RegistryProcess]:
    with start_registry(tmp_path / "registry") as reg:
        yield reg


def _cache(tmp_path: Path, registry: RegistryProcess, **access: str) -> ImageCache:
    return ImageCache(
        tmp_path / "cache",
        {registry.address: RegistryAccess(ca_file=registry.ca_file, **access)},
        client_options={"first_pause": 0.05, "retries": 8},
    )


def _entry(name: str, kind: bytes, **fields: object) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mtime = kind, 1_700_000_000
    info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
    for key, value in fields.items():
        setattr(info, key, value)
    return info


def _files(root: Path) -> dict[str, bytes | str]:
    found: dict[str, bytes | str] = {}
    for folder, dirs, names in os.walk(root):
        for name in dirs + names:
            path = Path(folder, name)
            rel = str(path.relative_to(root))
            if path.is_symlink():
                found[rel] = "-> " + os.readlink(path)
            elif path.is_file():
                found[rel] = path.read_bytes()
    return found


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _cached_blobs(tmp_path: Path) -> list[str]:
    blobs = tmp_path / "cache" / "blobs" / "sha256"
    return sorted(p.name for p in blobs.iterdir()) if blobs.exists() else []


async def test_an_image_is_pulled_verified_and_unpacked(
    tmp_path: Path, registry: RegistryProcess
) -> None:
    lower = tar_layer([("etc/os-release", b"ID=test\n"), ("etc/gone", b"x"),
                       ("opt/app/main.py", b"print('hi')\n")])  # fmt: skip
    upper = tar_layer(
        [
            _entry("etc/.wh.gone", tarfile.REGTYPE),
            _entry("usr/bin/tool", tarfile.SYMTYPE, linkname="/opt/app/main.py"),
            ("opt/app/data.bin", bytes(range(256)) * 64),
        ]
    )
    config = {"Env": ["PATH=/usr/bin", "LANG=C.UTF-8"], "WorkingDir": "/opt/app",
              "Entrypoint": ["python3"], "Cmd": ["main.py"], "User": "1000:1000"}  # fmt: skip
    pushed = registry.push_image("team/app", [lower, upper], config=config)
    ref = parse_image_ref(pushed.ref_text(registry.address))
    seen: list[PullProgress] = []
    cache = _cache(tmp_path, registry)

    ready = await cache.ensure(ref, seen.append)

    assert ready.root == tmp_path / "cache" / "roots" / pushed.digest_hex
    assert _files(ready.root) == {
        "etc/os-release": b"ID=test\n",
        "opt/app/main.py": b"print('hi')\n",
        "opt/app/data.bin": bytes(range(256)) * 64,
        "usr/bin/tool": "-> /opt/app/main.py",
    }
    assert ready.config == ImageConfig(("PATH=/usr/bin", "LANG=C.UTF-8"), "/opt/app",
                                       ("python3",), ("main.py",), "1000:1000")  # fmt: skip
    assert ready.manifest_digest == f"sha256:{pushed.digest_hex}" and ready.layers == 2
    total = len(pushed.config) + len(lower) + len(upper)
    assert seen[-1] == PullProgress(total, total, 2, 2, "ready")
    assert [p.bytes_done for p in seen] == sorted(p.bytes_done for p in seen)
    assert {p.phase for p in seen} == {"pulling", "unpacking", "ready"}
    assert not list((tmp_path / "cache" / "partial").iterdir())

    # Ready means ready without the registry: a second ensure (a new cache object, as after an
    # agent restart) answers from the disk with the registry gone.
    registry.stop()
    again = _cache(tmp_path, registry)
    assert await again.ensure(ref) == ready and again.clients == []


async def test_an_index_is_resolved_to_the_nodes_platform(
    tmp_path: Path, registry: RegistryProcess
) -> None:
    amd = registry.push_image("team/multi", [tar_layer([("arch", b"amd64")])], tag="amd64")
    arm = registry.push_image("team/multi", [tar_layer([("arch", b"arm64")])], tag="arm64")
    index = registry.push_index("team/multi", {"linux/arm64": arm, "linux/amd64": amd})
    ref = parse_image_ref(index.ref_text(registry.address))
    cache = _cache(tmp_path, registry)
    ready = await cache.ensure(ref)
    assert (ready.root / "arch").read_bytes() == b"amd64"
    assert ready.manifest_digest == f"sha256:{amd.digest_hex}"
    assert ready.root.name == index.digest_hex


async def test_a_missing_image_is_a_sentence_and_caches_nothing(
    tmp_path: Path, registry: RegistryProcess
) -> None:
    registry.push_image("team/app", [tar_layer([("a", b"a")])])
    ref = ImageRef(registry.address, "team/app", "0" * 64)
    with pytest.raises(ImageNotFound) as caught:
        await _cache(tmp_path, registry).ensure(ref)
    message = str(caught.value)
    assert f"{registry.address}/team/app@sha256:{'0' * 64}" in message and "HTTP 404" in message
    assert _cached_blobs(tmp_path) == []


async def test_a_corrupt_blob_is_refused_and_nothing_lands_in_blobs(
    tmp_path: Path, registry: RegistryProcess
) -> None:
    layer = tar_layer([("etc/data", os.urandom(4096))], gzipped=False)
    pushed = registry.push_image("team/app", [layer], layer_type=LAYER_TAR)
    layer_hex = RegistryProcess.sha256(layer)
    # The registry's own storage serves other bytes of the same length for the layer.
    registry.blob_data(layer_hex).write_bytes(bytes(len(layer)))
    ref = parse_image_ref(pushed.ref_text(registry.address))

    with pytest.raises(DigestMismatch) as caught:
        await _cache(tmp_path, registry).ensure(ref)

    assert f"sha256:{layer_hex}" in str(caught.value) and "corrupt" in str(caught.value)
    assert layer_hex not in _cached_blobs(tmp_path)
    # The layer's partial is gone; another blob cancelled mid-way may keep its own to resume.
    assert not (tmp_path / "cache" / "partial" / layer_hex).exists()
    assert not (tmp_path / "cache" / "roots").exists()
    assert not (tmp_path / "cache" / "images").exists()


async def test_a_registry_killed_mid_blob_is_resumed_with_a_range_request(
    tmp_path: Path, registry: RegistryProcess
) -> None:
    content = os.urandom(48 << 20)
    layer = tar_layer([("big.bin", content)], gzipped=False)
    pushed = registry.push_image("team/big", [layer], layer_type=LAYER_TAR)
    ref = parse_image_ref(pushed.ref_text(registry.address))
    cache = _cache(tmp_path, registry)
    killed_at: list[int] = []
    killed = trio.Event()

    def progress(p: PullProgress) -> None:
        # SIGKILL the registry (synchronously, so the kill lands while the blob still streams)
        # once 4 MiB of it are on disk.
        if not killed_at and p.bytes_done >= len(pushed.config) + (4 << 20):
            registry.kill()
            killed_at.append(p.bytes_done)
            killed.set()

    async def restart() -> None:
        await killed.wait()
        await trio.to_thread.run_sync(registry.start)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(restart)
        ready = await cache.ensure(ref, progress)

    assert killed_at and killed_at[0] < len(layer) and registry.starts == 2
    (client,) = cache.clients
    assert client.stats.range_requests >= 1 and client.stats.restarts == 0
    # Resumed, not restarted: no more than the blob's bytes (and the config) came over the wire.
    assert client.stats.blob_bytes == len(layer) + len(pushed.config)
    assert (ready.root / "big.bin").read_bytes() == content


async def test_concurrent_ensures_of_one_image_pull_each_blob_once(
    tmp_path: Path, registry: RegistryProcess
) -> None:
    layers = [tar_layer([(f"layer{i}", os.urandom(1 << 20))]) for i in range(3)]
    pushed = registry.push_image("team/app", layers)
    ref = parse_image_ref(pushed.ref_text(registry.address))
    # Two ensures on one cache object, and one on another object over the same folder (as a
    # second agent process would be: its locks are the flock files, not the first's trio.Lock).
    first, second = _cache(tmp_path, registry), _cache(tmp_path, registry)
    results = []

    async def ensure(cache: ImageCache) -> None:
        results.append(await cache.ensure(ref))

    async with trio.open_nursery() as nursery:
        for cache in (first, first, second):
            nursery.start_soon(ensure, cache)

    assert len(results) == 3 and results[0] == results[1] == results[2]
    for blob in (*layers, pushed.config):
        assert registry.blob_gets(RegistryProcess.sha256(blob)) == 1
    assert sorted(p.name for p in results[0].root.iterdir()) == ["layer0", "layer1", "layer2"]


async def test_a_hostile_layer_is_refused_and_writes_nothing_outside(
    tmp_path: Path, registry: RegistryProcess
) -> None:
    outside = tmp_path / "outside"  # an absolute link target of our own, never "/"
    outside.mkdir()
    cache = _cache(tmp_path, registry)
    hostile: dict[str, list[tarfile.TarInfo | tuple[str, bytes]]] = {
        "climbs": [("../escaped", b"owned")],
        "through-link": [
            _entry("etc", tarfile.SYMTYPE, linkname=str(outside)),
            ("etc/x", b"owned"),
        ],
    }
    for name, entries in hostile.items():
        pushed = registry.push_image(f"team/{name}", [tar_layer(entries)])
        ref = parse_image_ref(pushed.ref_text(registry.address))
        with pytest.raises(ImageRefused) as caught:
            await cache.ensure(ref)
        assert f"team/{name}@sha256:{pushed.digest_hex}" in str(caught.value)
        assert "Nothing of it was installed" in str(caught.value)
        assert not cache.root_path(ref).exists()
    assert _names(outside) == []
    assert _names(tmp_path / "cache" / "roots") == []  # no root, no build folder left
    assert _names(tmp_path) == ["cache", "outside", "registry"]

    # A device node is skipped: the member's /dev comes from the sandbox, never the image.
    pushed = registry.push_image(
        "team/device",
        [
            tar_layer(
                [
                    _entry("dev/sda", tarfile.BLKTYPE, devmajor=8, devminor=0),
                    _entry("dev/null", tarfile.CHRTYPE, devmajor=1, devminor=3),
                    ("bin/ok", b"ok"),
                ]
            )
        ],
    )
    ready = await cache.ensure(parse_image_ref(pushed.ref_text(registry.address)))
    assert _files(ready.root) == {"bin/ok": b"ok"}


async def test_basic_auth_with_wrong_credentials_is_refused_and_caches_nothing(
    tmp_path: Path,
) -> None:
    with start_registry(tmp_path / "registry", users={"puller": "right-secret"}) as registry:
        pushed = registry.push_image("team/private", [tar_layer([("secret", b"s")])])
        ref = parse_image_ref(pushed.ref_text(registry.address))

        with pytest.raises(RegistryAuthRefused) as wrong:
            await _cache(tmp_path, registry, username="puller", password="wrong").ensure(ref)
        assert "refused the credentials of user 'puller'" in str(wrong.value)
        assert "wrong" not in str(wrong.value)  # a password is never told
        with pytest.raises(RegistryAuthRefused) as none:
            await _cache(tmp_path, registry).ensure(ref)
        assert "this Node holds none" in str(none.value)
        assert _cached_blobs(tmp_path) == []
        assert not (tmp_path / "cache" / "roots").exists()

        cache = _cache(tmp_path, registry, username="puller", password="right-secret")
        ready = await cache.ensure(ref)
        assert (ready.root / "secret").read_bytes() == b"s"


def test_tar_layer_helper_writes_what_it_is_given() -> None:
    raw = tar_layer([("a/b", b"data")], gzipped=False)
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        member = tar.extractfile("a/b")
        assert member is not None and member.read() == b"data"


async def test_a_registry_answering_busy_is_retried_with_the_pause_it_asks_for(
    tmp_path: Path, registry: RegistryProcess
) -> None:
    layer = tar_layer([("app/main.py", b"print('up')\n")])
    pushed = registry.push_image("team/busy", [layer])
    # An overloaded registry behind its load balancer: the manifest twice, a blob once.
    failures = {"/manifests/": [503, 429], "/blobs/": [502]}
    with busy_proxy(registry, failures, retry_after="0") as proxy:
        ref = parse_image_ref(pushed.ref_text(proxy.address))
        cache = ImageCache(
            tmp_path / "cache",
            {proxy.address: RegistryAccess(ca_file=registry.ca_file)},
            client_options={"first_pause": 0.01, "retries": 3},
        )
        ready = await cache.ensure(ref)
    assert (ready.root / "app" / "main.py").read_bytes() == b"print('up')\n"
    assert sorted(status for _, status in proxy.failed()) == [429, 502, 503]
    (client,) = cache.clients
    assert client.stats.retries == 3


async def test_a_registry_that_stays_busy_fails_the_pull_with_a_sentence(
    tmp_path: Path, registry: RegistryProcess
) -> None:
    layer = tar_layer([("big.bin", os.urandom(1 << 16))], gzipped=False)
    pushed = registry.push_image("team/down", [layer], layer_type=LAYER_TAR)
    layer_hex = hashlib.sha256(layer).hexdigest()
    with busy_proxy(registry, {f"/blobs/sha256:{layer_hex}": [503] * 10}) as proxy:
        ref = parse_image_ref(pushed.ref_text(proxy.address))
        cache = ImageCache(
            tmp_path / "cache",
            {proxy.address: RegistryAccess(ca_file=registry.ca_file)},
            client_options={"first_pause": 0.01, "retries": 2},
        )
        with pytest.raises(RegistryFailed) as caught:
            await cache.ensure(ref)
    message = str(caught.value)
    assert f"answered HTTP 503 for {proxy.address}/team/down@sha256:{layer_hex}" in message
    assert "3 times in a row" in message and "once the registry is healthy" in message
    assert len(proxy.failed()) == 3  # the first try and two retries, no more
    assert layer_hex not in _cached_blobs(tmp_path)
    assert not (tmp_path / "cache" / "roots").exists()


def test_the_pause_doubles_honours_retry_after_and_is_capped() -> None:
    assert [retry_pause(0.25, n, None) for n in range(4)] == [0.25, 0.5, 1.0, 2.0]
    assert retry_pause(0.25, 0, 3.0) == 3.0 and retry_pause(0.25, 2, 0.1) == 1.0
    assert retry_pause(0.25, 10, None) == MAX_PAUSE_S and retry_pause(0.25, 0, 60) == MAX_PAUSE_S
    assert retry_after("5") == 5.0 and retry_after(" 0 ") == 0.0
    assert retry_after("Wed, 21 Oct 2026 07:28:00 GMT") is None and retry_after("") is None
