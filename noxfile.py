"""Sessions people run: ``nox -s tests``, ``lint``, ``proto``, ``bench``, ``demo``."""

from __future__ import annotations

import os
import shutil

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True
nox.options.default_venv_backend = "venv"

# The generator is pinned exactly: its output is committed and checked for drift.
PROTO_TOOLS = [
    "betterproto[compiler]==2.0.0b7",
    "grpcio-tools==1.85.1",
    "black==26.10.1",
    "isort==5.13.2",
]
# The PyTorch DDP example (examples/pytorch-ddp) is tested for real, so the tests need torch: the
# CPU build from PyTorch's own index, which pulls no CUDA libraries (PyPI's torch would). Not in
# pyproject's test extra for that reason.
TORCH_CPU = ["torch==2.13.0+cpu", "--extra-index-url", "https://download.pytorch.org/whl/cpu"]
# The folders that install as tuneplane.* (pyproject.toml's package-dir).
PACKAGE_FOLDERS = ["agent", "collector", "coordinator", "proto", "runner"]


@nox.session
def tests(session: nox.Session) -> None:
    """Install TunePlane with its test extras and run the whole suite.

    As root (CI), the distribution's packages in ``wanted`` below are installed when missing
    (bubblewrap, faketime, strace, prometheus for promtool, the Distribution registry and htpasswd,
    busybox-static and debootstrap for the image tests' root filesystems, chromium for the
    console's browser tests, Slurm with slurmrestd and its JWT plugin for the Slurm Fleet
    tests), so the tests that need them run instead of skipping (under CI=true a missing
    prerequisite fails them).
    torch (CPU build) is installed for the PyTorch DDP example's test. Without arguments the
    suite runs on every core (``-n auto --dist loadfile``); ``nox -s tests -- tests/ha -x`` runs
    what you name, in one process.
    """
    session.install("-e", ".[test]")
    session.install(*TORCH_CPU)
    wanted = {
        "bubblewrap": "bwrap",
        "faketime": "faketime",
        # Durability tests watch a real process's fsync and rename calls.
        "strace": "strace",
        "prometheus": "promtool",
        # A real OCI registry for the runtime image tests, and htpasswd for its users.
        "docker-registry": "docker-registry",
        "apache2-utils": "htpasswd",
        # Test root filesystems for images: a static busybox and a debootstrapped Debian.
        "busybox-static": "busybox",
        "debootstrap": "debootstrap",
        # The console's browser tests drive Debian's chromium through Playwright.
        "chromium": "chromium",
        # A throwaway Slurm cluster with slurmrestd and JWT for the Slurm Fleet tests
        # (coordinator/demo/slurm.py); the JWT plugin installs no binary, so its library stands in.
        "slurm-wlm": "slurmctld",
        "munge": "munged",
        "slurmrestd": "slurmrestd",
        "slurm-wlm-jwt-plugin": "/usr/lib/x86_64-linux-gnu/slurm-wlm/auth_jwt.so",
    }

    def present(tool: str) -> bool:
        return os.path.exists(tool) if tool.startswith("/") else shutil.which(tool) is not None

    missing = [package for package, tool in wanted.items() if not present(tool)]
    if os.geteuid() == 0 and missing:
        quiet = {"DEBIAN_FRONTEND": "noninteractive"}
        session.run("apt-get", "update", "-q", external=True, env=quiet)
        session.run("apt-get", "install", "-y", "-q", *missing, external=True, env=quiet)
    # The package's bytecode, written once: every agent, coordinator and CLI process the tests
    # start reads it instead of compiling TunePlane's modules again (an editable install has
    # none, and PYTHONDONTWRITEBYTECODE, where set, keeps each process from writing its own).
    session.run("python", "-m", "compileall", "-q", *PACKAGE_FOLDERS)
    # The whole suite runs on every core (pytest-xdist), each test file on one worker so a
    # file's shared coordinator or network is made once; most tests wait on real processes, so
    # two workers finish a 2-core machine's run well before one would. Arguments replace this.
    session.run("pytest", *(session.posargs or ("-n", "auto", "--dist", "loadfile")))


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (style, imports, bugs) and mypy --strict over every package."""
    session.install("-e", ".[lint,test]")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("python", "tools/typecheck.py", *session.posargs)


@nox.session
def proto(session: nox.Session) -> None:
    """Regenerate proto/v1 from proto/tuneplane/v1/*.proto; ``-- --check`` fails on drift."""
    session.install(*PROTO_TOOLS)
    session.run("python", "proto/generate.py", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks: ``nox -s bench -- agent|console|coordinator|heartbeats|idle|images|telemetry``
    (all when none is named)."""
    session.install("-e", ".[test]")
    session.run("python", "-m", "bench", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """A real coordinator and two real agents on loopback running the bundled example job
    (``nox -s demo -- --store postgresql``: on an embedded PostgreSQL; ``-- --ha``: with a
    standby coordinator there, the leader killed mid-Job; ``-- --slurm``: on a throwaway Slurm
    cluster through a Fleet of kind slurm, as root with Slurm installed)."""
    postgres = any(arg.endswith("postgresql") or arg == "--ha" for arg in session.posargs)
    session.install("-e", ".[postgresql]" if postgres else ".")
    session.run("tuneplane", "demo", *session.posargs)
