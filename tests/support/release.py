"""The previous TunePlane release, installed from its source archive into a virtual environment
of its own, for tests that run it beside this checkout (rolling upgrades, docs/operator.md).

Rules:
- Each release is tagged ``vX.Y.Z`` and its source (the tag's tree without tests, docs, bench,
  examples and tools) is committed as ``tests/releases/tuneplane-X.Y.Z.tar.gz``
  (docs/releasing.md). The archive, not the tag, is what the test installs: a CI checkout
  carries the files of its commit but not necessarily its tags or history.
- The previous release is the newest archive older than the version in pyproject.toml. Its
  ``pyproject.toml`` must say the version its file name says.
- It is installed with ``pip install --no-deps`` into a venv whose ``.pth`` line reaches this
  test environment's dependencies (the pins are the same; nothing is downloaded). The venv is
  built once per archive (named by its digest) under the system temporary folder, ready only
  once its marker is written.
- :attr:`Release.prefix` is a command prefix (the ``prefix_argv`` the process helpers take) that
  runs a command written for this interpreter (``sys.executable -m ...``) under the release's.
- No archive older than this version: the test skips saying so, and under ``CI=true`` fails.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import tomllib
from pathlib import Path

import attrs
import pytest

REPO = Path(__file__).resolve().parents[2]
ARCHIVES = REPO / "tests" / "releases"


@attrs.frozen
class Release:
    """One release installed in its own venv."""

    version: str
    venv: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def prefix(self) -> tuple[str, ...]:
        """Run ``[sys.executable, *args]`` as ``[release python, *args]``."""
        return (str(self.venv / "bin" / "as-release"),)


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def current_version() -> str:
    data = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    return str(data["project"]["version"])


def _unavailable(why: str) -> None:
    sentence = f"needs the previous TunePlane release's source archive: {why}"
    if os.environ.get("CI") == "true":
        pytest.fail(sentence)
    pytest.skip(sentence)


def previous_archive() -> tuple[str, Path]:
    """The newest ``tests/releases/tuneplane-X.Y.Z.tar.gz`` older than pyproject.toml's
    version, with its version."""
    ours = _version_tuple(current_version())
    found: list[tuple[tuple[int, ...], str, Path]] = []
    for path in ARCHIVES.glob("tuneplane-*.tar.gz"):
        version = path.name.removeprefix("tuneplane-").removesuffix(".tar.gz")
        try:
            numbers = _version_tuple(version)
        except ValueError:
            continue
        if numbers < ours:
            found.append((numbers, version, path))
    if not found:
        _unavailable(
            f"{ARCHIVES.relative_to(REPO)}/ has no tuneplane-X.Y.Z.tar.gz older than "
            f"{current_version()} (docs/releasing.md says how to add one)"
        )
    _, version, path = max(found)
    return version, path


def _extract(archive: Path, version: str, into: Path) -> Path:
    """Unpack ``archive`` under ``into``; its source folder, checked to be ``version``'s."""
    with tarfile.open(archive, "r:gz") as tar:
        tar.extractall(into, filter="data")
    source = into / f"tuneplane-{version}"
    data = tomllib.loads((source / "pyproject.toml").read_text(encoding="utf-8"))
    said = str(data["project"]["version"])
    if said != version:
        raise RuntimeError(
            f"{archive} holds version {said} in its pyproject.toml, not {version} as its name "
            "says: rebuild it from the tag (docs/releasing.md)."
        )
    return source


def previous_release() -> Release:
    """The previous release installed in its own venv (built now, or reused)."""
    version, archive = previous_archive()
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    venv = Path(tempfile.gettempdir()) / f"tuneplane-release-{version}-{digest[:12]}"
    release = Release(version, venv)
    if (venv / "ready").exists():
        return release
    building = Path(tempfile.mkdtemp(prefix=f"{venv.name}.", dir=venv.parent))
    source = _extract(archive, version, building / "source")
    env_dir = building / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120
    )
    # This test environment's dependencies (pip and setuptools among them), after the venv's own
    # site-packages (where the release is installed, so it is what `import tuneplane` finds).
    site = Path(sysconfig.get_paths()["purelib"])
    ours = next((env_dir / "lib").glob("python3*/site-packages"))
    (ours / "tuneplane-test-dependencies.pth").write_text(f"{site}\n")
    installed = subprocess.run(
        [str(env_dir / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps",
         "--no-build-isolation", "--no-index", str(source)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    if installed.returncode != 0:
        raise RuntimeError(f"installing {version} failed:\n{installed.stdout}\n{installed.stderr}")
    shim = env_dir / "bin" / "as-release"
    # The venv moves into place below: the shim names the final path.
    # -P: the working directory (a checkout's tuneplane.egg-info) is not on sys.path.
    shim.write_text(f'#!/bin/sh\nshift\nexec "{venv}/bin/python" -P "$@"\n')
    shim.chmod(0o755)
    shutil.rmtree(building / "source")
    if venv.exists():
        shutil.rmtree(venv)  # a build cut short before its marker
    try:
        env_dir.rename(venv)
    except OSError:
        # Another test process built it meanwhile; use that one.
        shutil.rmtree(building, ignore_errors=True)
        return release
    building.rmdir()
    (venv / "ready").write_text(digest + "\n")
    return release
