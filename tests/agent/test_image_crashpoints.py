"""A real process that pulls an image dies (status 137, as SIGKILLed) at a named crash point, and
a later ensure resumes or completes from what it left, with the right files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.oci_registry import LAYER_TAR, RegistryProcess, start_registry, tar_layer
from tuneplane.agent.image_cache import ImageCache
from tuneplane.agent.image_pull import RegistryAccess
from tuneplane.agent.image_ref import parse_image_ref

pytestmark = pytest.mark.timeout(120)

# The pulling process: ensure the image named by argv into the cache folder of argv.
PULLER = """
import sys, trio
from pathlib import Path
from tuneplane.agent.image_cache import ImageCache
from tuneplane.agent.image_pull import RegistryAccess
from tuneplane.agent.image_ref import parse_image_ref
folder, ref, registry, ca = sys.argv[1:5]
cache = ImageCache(Path(folder), {registry: RegistryAccess(ca_file=Path(ca))})
trio.run(cache.ensure, parse_image_ref(ref))
print("ready")
"""


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[RegistryProcess]:
    with start_registry(tmp_path / "registry") as reg:
        yield reg


def _pull_and_die(tmp_path: Path, registry: RegistryProcess, ref: str, point: str) -> str:
    env = dict(os.environ, TUNEPLANE_CRASHPOINT=point)
    cache = str(tmp_path / "cache")
    done = subprocess.run(
        [sys.executable, "-c", PULLER, cache, ref, registry.address, str(registry.ca_file)],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 137, done.stderr
    assert "ready" not in done.stdout
    return done.stderr


def _cache(tmp_path: Path, registry: RegistryProcess) -> ImageCache:
    return ImageCache(
        tmp_path / "cache", {registry.address: RegistryAccess(ca_file=registry.ca_file)}
    )


async def test_a_crash_mid_blob_is_resumed_from_the_partial(
    tmp_path: Path, registry: RegistryProcess
) -> None:
    content = os.urandom(8 << 20)
    layer = tar_layer([("big.bin", content)], gzipped=False)
    pushed = registry.push_image("team/big", [layer], layer_type=LAYER_TAR)
    ref = pushed.ref_text(registry.address)
    layer_hex = RegistryProcess.sha256(layer)

    # The third 1 MiB chunk written to any partial: the config (one chunk) and two of the layer.
    log = _pull_and_die(tmp_path, registry, ref, "mid-image-blob@3")
    assert "point=mid-image-blob" in log
    partial = tmp_path / "cache" / "partial" / layer_hex
    left = partial.stat().st_size
    assert 0 < left < len(layer)
    assert not (tmp_path / "cache" / "blobs" / "sha256" / layer_hex).exists()

    cache = _cache(tmp_path, registry)
    ready = await cache.ensure(parse_image_ref(ref))
    (client,) = cache.clients
    assert client.stats.range_requests == 1 and client.stats.restarts == 0
    assert client.stats.blob_bytes == len(layer) - left  # only what the crash had not written
    assert (ready.root / "big.bin").read_bytes() == content
    assert not partial.exists()


async def test_a_crash_before_the_root_is_renamed_is_completed_without_the_registry(
    tmp_path: Path, registry: RegistryProcess
) -> None:
    pushed = registry.push_image(
        "team/app", [tar_layer([("etc/a", b"a")]), tar_layer([("etc/b", b"b")])],
        config={"Cmd": ["/bin/true"]},
    )  # fmt: skip
    ref = pushed.ref_text(registry.address)

    log = _pull_and_die(tmp_path, registry, ref, "before-image-root-renamed")
    assert "point=before-image-root-renamed" in log
    roots = tmp_path / "cache" / "roots"
    (build,) = roots.iterdir()  # the unpacked root, never renamed into place
    assert build.name.startswith(f".build-{pushed.digest_hex}-")
    assert not (tmp_path / "cache" / "images").exists()

    # Every blob is verified on disk, so the registry is not needed to finish.
    registry.stop()
    cache = _cache(tmp_path, registry)
    ready = await cache.ensure(parse_image_ref(ref))
    assert cache.clients == []
    assert sorted(p.name for p in roots.iterdir()) == [pushed.digest_hex]  # the leftover is gone
    assert (ready.root / "etc/a").read_bytes() == b"a" and (
        ready.root / "etc/b"
    ).read_bytes() == b"b"
    record = json.loads(cache.record_path(ready.ref).read_text())
    assert record["config"]["Cmd"] == ["/bin/true"] and ready.config.cmd == ("/bin/true",)
