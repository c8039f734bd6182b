"""Runtime image preparation: cold and warm, ours against ``skopeo copy`` + ``umoci unpack``.

Rules: the bench installs nothing. It builds an image of about 1 GiB in a temporary folder
(six layers of incompressible random files and two of compressible text, gzip level 1), pushes
it to a real Distribution registry (``docker-registry``) it starts on loopback with TLS from a
test CA (tests/support/oci_registry.py, the one the tests use), and then alternates, run by run:

- ours, cold: ``ImageCache.ensure`` into an empty cache (pull, verify every blob's digest,
  unpack, syncfs, record); ours, warm: ``ensure`` again (the image is ready);
- baseline, cold: ``skopeo copy docker://… oci:DIR:bench`` into an empty layout, then
  ``umoci unpack --image DIR:bench ROOT``; baseline, warm: ``skopeo copy`` again into the same
  layout (it finds every blob there; the root is kept, as ours is).

It prints the medians and the ratios ours/baseline. Without ``skopeo`` or ``umoci`` it says how
to install them and prints our figures alone; without ``docker-registry`` it says so and stops.
Knobs (env): ``TUNEPLANE_BENCH_IMAGES_MIB`` (default 1024, the image's size before compression)
and ``TUNEPLANE_BENCH_IMAGES_RUNS`` (default 3 runs of each).
"""

from __future__ import annotations

import gzip
import io
import os
import shutil
import statistics
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

import trio

from tests.support.oci_registry import REGISTRY_BIN, RegistryProcess, start_registry
from tuneplane.agent.image_cache import ImageCache
from tuneplane.agent.image_pull import RegistryAccess
from tuneplane.agent.image_ref import ImageRef, parse_image_ref

INSTALL = "apt-get install skopeo umoci"
TOOL_TIMEOUT_S = 600
FILE_MIB = 8


def _layer(index: int, mib: int, compressible: bool) -> bytes:
    """A gzip (level 1) layer of ``mib`` MiB of files: random bytes, or repetitive text."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for n in range(max(1, mib // FILE_MIB)):
            size = min(FILE_MIB, mib) << 20
            if compressible:
                line = f"layer {index} file {n}: the quick brown fox jumps over the lazy dog\n"
                data = (line.encode() * (size // len(line) + 1))[:size]
            else:
                data = os.urandom(size)
            info = tarfile.TarInfo(f"opt/layer{index}/file{n}.bin")
            info.size, info.mode, info.mtime = len(data), 0o644, 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), compresslevel=1, mtime=0)


def _image(registry: RegistryProcess, total_mib: int) -> tuple[ImageRef, int]:
    """Push the bench's image; its reference and its bytes as pushed (compressed)."""
    random_mib, text_mib = total_mib * 3 // 4, total_mib - total_mib * 3 // 4
    layers = [_layer(i, max(1, random_mib // 6), False) for i in range(6)]
    layers += [_layer(6 + i, max(1, text_mib // 2), True) for i in range(2)]
    pushed = registry.push_image("bench/image", layers, config={"Cmd": ["/bin/true"]})
    return parse_image_ref(pushed.ref_text(registry.address)), sum(map(len, layers))


def _ours(folder: Path, registry: RegistryProcess, ref: ImageRef) -> float:
    cache = ImageCache(folder, {registry.address: RegistryAccess(ca_file=registry.ca_file)})
    started = time.perf_counter()
    trio.run(cache.ensure, ref)
    return time.perf_counter() - started


def _run(argv: list[str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
    return time.perf_counter() - started


def _skopeo(layout: Path, certs: Path, ref: ImageRef) -> float:
    source = f"docker://{ref.registry}/{ref.name}@{ref.digest}"
    return _run(["skopeo", "--insecure-policy", "copy", "--quiet", "--src-cert-dir", str(certs),
                 source, f"oci:{layout}:bench"])  # fmt: skip


def _umoci(layout: Path, root: Path) -> float:
    rootless = [] if os.geteuid() == 0 else ["--rootless"]
    return _run(["umoci", "unpack", *rootless, "--image", f"{layout}:bench", str(root)])


def _line(label: str, ours: list[float], base: list[float] | None) -> str:
    mine = statistics.median(ours)
    text = f"  {label:<6} ours median {mine:7.2f} s"
    if base:
        theirs = statistics.median(base)
        text += f"   skopeo+umoci median {theirs:7.2f} s   ratio ours/baseline {mine / theirs:5.2f}"
    return text


def main() -> int:
    total_mib = int(os.environ.get("TUNEPLANE_BENCH_IMAGES_MIB", "1024"))
    runs = int(os.environ.get("TUNEPLANE_BENCH_IMAGES_RUNS", "3"))
    if not os.path.exists(REGISTRY_BIN):
        print(f"images: needs the Distribution registry ({REGISTRY_BIN}); install it with "
              "`apt-get install docker-registry` and run again.")  # fmt: skip
        return 0
    missing = [tool for tool in ("skopeo", "umoci") if shutil.which(tool) is None]
    if missing:
        print(f"images: {' and '.join(missing)} not found: the baseline is left out and our "
              f"figures are printed alone; install them with `{INSTALL}`.")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="tp-bench-images-") as tmp:
        root = Path(tmp)
        with start_registry(root / "registry") as registry:
            made = time.perf_counter()
            ref, pushed = _image(registry, total_mib)
            took = time.perf_counter() - made
            print(f"image: {total_mib} MiB of files in 8 layers (6 random, 2 text), "
                  f"{pushed / 2**20:.0f} MiB compressed, built and pushed in {took:.0f} s; "
                  f"{runs} runs of each, alternating")  # fmt: skip
            certs = root / "certs"
            certs.mkdir()
            shutil.copyfile(registry.ca_file, certs / "ca.crt")
            cold: list[float] = []
            warm: list[float] = []
            base_cold: list[float] = []
            base_warm: list[float] = []
            for i in range(runs):
                cache = root / f"cache-{i}"
                cold.append(_ours(cache, registry, ref))
                warm.append(_ours(cache, registry, ref))
                shutil.rmtree(cache)
                if not missing:
                    layout, unpacked = root / f"oci-{i}", root / f"root-{i}"
                    base_cold.append(_skopeo(layout, certs, ref) + _umoci(layout, unpacked))
                    base_warm.append(_skopeo(layout, certs, ref))
                    shutil.rmtree(layout)
                    shutil.rmtree(unpacked)
    print(_line("cold", cold, base_cold))
    print(_line("warm", warm, base_warm))
    print(
        "  ours includes digest verification of every blob (SHA-256 of each layer and the "
        "config as it streams) and a syncfs before the root is put in place; warm: ours finds "
        "the image ready without the registry, the baseline's skopeo copy asks the registry and "
        "finds every blob in its layout (its root kept)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
