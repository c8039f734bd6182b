"""Real root filesystems for the tests that run members in an image: a small busybox one and a
Debian (``debootstrap --variant=minbase``) one with Python.

How to use it::

    from tests.support.rootfs import busybox_root, python_root

    def test_runs_in_the_image() -> None:
        root = busybox_root()      # skips (fails under CI=true) when busybox-static is missing
        ...

Rules:
- A root is built once and cached between runs, so CI stays fast: under ``/var/cache/tuneplane-
  tests`` as root, else under ``~/.cache/tuneplane-tests`` (``TUNEPLANE_TEST_CACHE`` overrides).
  Its folder name is a digest of what built it (the builder's version, the tool's package
  version, the suite and packages), so a changed recipe builds a new root and never reuses a
  stale one.
- A root is built in a temporary folder inside the cache folder and renamed into place, so a
  build that dies half-way is never mistaken for a root; a lock file makes parallel test
  workers build it once. Nothing is written outside the cache folder.
- Roots are read-only to the tests that use them: tests bind them read-only into a sandbox.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

#: Bump when a builder below changes what it puts in a root.
BUILDER_VERSION = "1"
BUSYBOX = Path("/bin/busybox")
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = os.environ.get("TUNEPLANE_TEST_DEBIAN_MIRROR", "http://deb.debian.org/debian")
#: A module that exists only in the Python root, never on the host.
IMAGE_ONLY_MODULE = "tp_image_only"
IMAGE_ONLY_TEXT = 'WHERE = "inside the test image"\n'
#: What /etc/os-release says in the busybox root (the host's says something else).
BUSYBOX_OS_RELEASE = 'NAME="TunePlane test busybox"\nID=tuneplane-busybox\n'
#: Seconds a root's build may take (debootstrap downloads ~40 MiB of packages).
BUILD_TIMEOUT_S = 900


class RootfsBuildError(Exception):
    """A test root filesystem could not be built; ``str()`` says what failed and how to fix it."""


def cache_dir() -> Path:
    """Where built roots live between test runs."""
    named = os.environ.get("TUNEPLANE_TEST_CACHE")
    if named:
        return Path(named)
    if os.geteuid() == 0:
        return Path("/var/cache/tuneplane-tests")
    return Path.home() / ".cache" / "tuneplane-tests"


def _require(ok: bool, what: str) -> None:
    """Skip the test (fail it under CI=true) unless ``ok``; ``what`` names what to install."""
    if ok:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run this test, but {what}.")
    pytest.skip(f"this test needs {what}")


def _package_version(package: str) -> str | None:
    """The installed version of a Debian package, or None when it is not installed."""
    if shutil.which("dpkg-query") is None:
        return None
    done = subprocess.run(
        ["dpkg-query", "-W", "-f", "${Status}\t${Version}", package],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    status, _, version = done.stdout.partition("\t")
    return version if done.returncode == 0 and status.endswith(" installed") else None


def _cached(name: str, key: str, build: Callable[[Path], None]) -> Path:
    """The root ``name-<digest of key>`` in the cache, built by ``build(folder)`` when absent."""
    digest = hashlib.sha256(f"{BUILDER_VERSION}\n{key}".encode()).hexdigest()[:16]
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    final = cache / f"{name}-{digest}"
    if final.is_dir():
        return final
    with open(cache / f"{name}-{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be building the same root
        if final.is_dir():
            return final
        building = Path(tempfile.mkdtemp(prefix=f".{name}-{digest}-", dir=cache))
        try:
            build(building)
            building.chmod(0o755)
            os.rename(building, final)
        finally:
            if building.exists():
                shutil.rmtree(building)
    return final


def layer_tar(root: Path) -> Path:
    """``root`` (one of this module's cached roots) as one uncompressed OCI layer: a tar that
    Python's tarfile writes entry by entry (owners, modes, links and hard links as they are; no
    ``./`` prefix), cached beside the root as ``<root>.layer.tar`` and built once (under a lock,
    renamed into place when whole). Only the cache folder is written."""
    final = root.with_name(f"{root.name}.layer.tar")
    if final.is_file():
        return final
    with open(root.with_name(f"{root.name}.layer.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if final.is_file():
            return final
        fd, building = tempfile.mkstemp(prefix=f".{root.name}-layer-", dir=root.parent)
        os.close(fd)
        try:
            with tarfile.open(building, "w", format=tarfile.PAX_FORMAT) as tar:
                for folder, dirs, files in os.walk(root):
                    dirs.sort()
                    rel = os.path.relpath(folder, root)
                    for name in sorted(dirs) + sorted(files):
                        arcname = name if rel == "." else f"{rel}/{name}"
                        tar.add(os.path.join(folder, name), arcname=arcname, recursive=False)
            os.chmod(building, 0o644)
            os.rename(building, final)
        finally:
            if os.path.exists(building):
                os.unlink(building)
    return final


def _is_static(program: Path) -> bool:
    """Whether ``program`` is an executable that needs no loader (ldd says it is not dynamic)."""
    if not program.is_file() or shutil.which("ldd") is None:
        return False
    done = subprocess.run(
        ["ldd", str(program)], capture_output=True, text=True, timeout=30, check=False
    )
    said = done.stdout + done.stderr
    return "not a dynamic executable" in said or "statically linked" in said


def _build_busybox(root: Path) -> None:
    (root / "bin").mkdir()
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    listed = subprocess.run(
        [str(BUSYBOX), "--list-full"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    for applet in listed.split():
        link = root / applet
        if link.name == "busybox" or link.exists() or link.is_symlink():
            continue
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to("/bin/busybox")
    etc = root / "etc"
    etc.mkdir(exist_ok=True)
    (etc / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
    )
    (etc / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
    (etc / "os-release").write_text(BUSYBOX_OS_RELEASE)
    # No /proc, /dev, /tmp, /etc/hosts or /etc/resolv.conf: the sandbox must make the mount
    # points an image lacks without writing to the image (agent/image_sandbox.py, underlays).


def busybox_root() -> Path:
    """A small root: Debian's static busybox (busybox-static) as ``/bin/busybox``, its applets
    as links to it, a minimal ``/etc/passwd`` and ``/etc/group``, and an ``/etc/os-release`` of
    its own.

    Skips the test (fails under ``CI=true``) when the host's ``/bin/busybox`` is missing or is
    not the static one (the image has no C library for a dynamic one).
    """
    _require(
        _is_static(BUSYBOX),
        f"a statically linked {BUSYBOX} (apt-get install busybox-static) to build a busybox root",
    )
    digest = hashlib.sha256(BUSYBOX.read_bytes()).hexdigest()
    return _cached("busybox", f"busybox {digest}", _build_busybox)


def _build_debian(root: Path) -> None:
    argv = [
        "debootstrap", "--variant=minbase", "--include=python3", DEBIAN_SUITE, str(root),
        DEBIAN_MIRROR,
    ]  # fmt: skip
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        raise RootfsBuildError(
            f"debootstrap took over {BUILD_TIMEOUT_S} s to build the Python test root from "
            f"{DEBIAN_MIRROR}; check that this machine reaches the mirror, or name a closer one "
            "with TUNEPLANE_TEST_DEBIAN_MIRROR."
        ) from None
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
        raise RootfsBuildError(
            f"debootstrap could not build the Python test root from {DEBIAN_MIRROR} (exit "
            f"{done.returncode}: {' / '.join(tail)}); check that this machine reaches the "
            "mirror, or name another with TUNEPLANE_TEST_DEBIAN_MIRROR."
        )
    site = root / "usr" / "lib" / "python3" / "dist-packages"
    site.mkdir(parents=True, exist_ok=True)
    (site / f"{IMAGE_ONLY_MODULE}.py").write_text(IMAGE_ONLY_TEXT)
    # The downloaded .deb files are half the root's size and no test reads them.
    for deb in (root / "var" / "cache" / "apt" / "archives").glob("*.deb"):
        deb.unlink()


def python_root() -> Path:
    """A Debian root (``debootstrap --variant=minbase --include=python3 bookworm``) with the
    module ``tp_image_only`` in its site-packages, which exists only in this root.

    Skips the test (fails under ``CI=true``) when debootstrap is missing or the tests do not run
    as root (debootstrap needs root to set owners and make device nodes).
    """
    version = _package_version("debootstrap")
    _require(
        version is not None and os.geteuid() == 0,
        "root and Debian's debootstrap (apt-get install debootstrap) to build the Python root",
    )
    key = f"debootstrap {version} minbase {DEBIAN_SUITE} python3 {IMAGE_ONLY_TEXT}"
    return _cached("python", key, _build_debian)
