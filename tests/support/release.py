"""The previous tagged TunePlane release, installed from its tag into a virtual environment of its
own, for tests that run it beside this checkout (rolling upgrades, docs/operator.md).

Rules:
- Releases are tagged ``vX.Y.Z`` on the commit they were made from (docs/releasing.md). The
  previous release is the newest tag on this checkout's history older than the version in
  pyproject.toml.
- Its source comes from the tag (``git archive``), never from the working tree; it is installed
  with ``pip install --no-deps`` into a venv whose ``.pth`` line reaches this test environment's
  dependencies (the pins are the same; nothing is downloaded). The venv is built once per tag
  commit and kept under the system temporary folder, ready only once its marker is written.
- :attr:`Release.prefix` is a command prefix (the ``prefix_argv`` the process helpers take) that
  runs a command written for this interpreter (``sys.executable -m ...``) under the release's.
- No git, no checkout history or no such tag: the test skips saying so, and under ``CI=true``
  fails (CI runs on a clone that has its tags).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import tomllib
from pathlib import Path

import attrs
import pytest

REPO = Path(__file__).resolve().parents[2]


@attrs.frozen
class Release:
    """One release installed in its own venv."""

    tag: str
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
    sentence = f"needs the previous tagged TunePlane release: {why}"
    if os.environ.get("CI") == "true":
        pytest.fail(sentence)
    pytest.skip(sentence)


def _git(*args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=60, check=False
    )
    if done.returncode != 0:
        _unavailable(f"`git {' '.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


def previous_tag() -> str:
    """The newest ``vX.Y.Z`` tag on HEAD's history older than pyproject.toml's version."""
    if shutil.which("git") is None:
        _unavailable("git is not installed")
    ours = _version_tuple(current_version())
    tags: list[tuple[tuple[int, ...], str]] = []
    for line in _git("tag", "--list", "v*", "--merged", "HEAD").split():
        try:
            version = _version_tuple(line[1:])
        except ValueError:
            continue
        if version < ours:
            tags.append((version, line))
    if not tags:
        _unavailable(f"this checkout has no vX.Y.Z tag older than {current_version()}")
    return max(tags)[1]


def previous_release() -> Release:
    """The previous release installed in its own venv (built now, or reused)."""
    tag = previous_tag()
    commit = _git("rev-list", "-n", "1", tag).strip()
    venv = Path(tempfile.gettempdir()) / f"tuneplane-release-{tag}-{commit[:12]}"
    release = Release(tag, tag[1:], venv)
    if (venv / "ready").exists():
        return release
    building = Path(tempfile.mkdtemp(prefix=f"{venv.name}.", dir=venv.parent))
    source = building / "source"
    source.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", commit],
        capture_output=True, timeout=120, check=True,
    )  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True)
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
        raise RuntimeError(f"installing {tag} failed:\n{installed.stdout}\n{installed.stderr}")
    shim = env_dir / "bin" / "as-release"
    # The venv moves into place below: the shim names the final path.
    # -P: the working directory (a checkout's tuneplane.egg-info) is not on sys.path.
    shim.write_text(f'#!/bin/sh\nshift\nexec "{venv}/bin/python" -P "$@"\n')
    shim.chmod(0o755)
    shutil.rmtree(source)
    if venv.exists():
        shutil.rmtree(venv)  # a build cut short before its marker
    try:
        env_dir.rename(venv)
    except OSError:
        # Another test process built it meanwhile; use that one.
        shutil.rmtree(building, ignore_errors=True)
        return release
    building.rmdir()
    (venv / "ready").write_text(commit + "\n")
    return release
