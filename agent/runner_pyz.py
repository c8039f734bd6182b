"""The runner a member runs: this Node's runner sources sealed into the capsule as ``runner.pyz``.

Rules: the zip is deterministic (sorted entries, fixed timestamps and modes), so one installed
runner always gives the same bytes and sha256. Prepare writes it atomically next to its digest
file ``runner.sha256`` and reads it back; the launch runs it only when it still matches.

The runner's own modules (``__main__`` and ``tuneplane.runner``) also ship as bytecode for the
interpreter that builds the zip, which is the one that starts the runner (the agent's
``sys.executable``): without it every start compiled every module again, a fifth of the start.
Each ``.pyc`` is an unchecked hash-based pyc (PEP 552) next to its ``.py``: zipimport loads it
without reading the source (the zip is verified by sha256 already), and the bytes depend only on
the sources and the interpreter. Another interpreter (the agent upgraded between Prepare and launch)
refuses the magic number and zipimport compiles the ``.py`` instead, as before. The
``tuneplane.report`` SDK stays source only: the workload imports it from this zip with its own
Python, and its ``__file__`` and tracebacks name the ``.py`` in the capsule as they always did.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import io
import logging
import marshal
import zipfile
from pathlib import Path

from .atomic_file import DirSync, write_atomic

log = logging.getLogger(__name__)

#: The workload's cwd inside the member directory, and the Job Capsule inside that.
WORK_DIR = "work"
CAPSULE_DIR = ".tuneplane/capsule"
RUNNER_PYZ = "runner.pyz"
RUNNER_DIGEST = "runner.sha256"

# 1980-01-01 is the earliest time a zip entry can hold; any fixed value makes the bytes repeat.
_FIXED_TIME = (1980, 1, 1, 0, 0, 0)
_FILE_MODE = 0o100644
# Inside the zip ``tuneplane`` is a regular package: zipimport finds no namespace portion in a
# zip without directory entries, and an editable or installed ``tuneplane`` elsewhere on the
# path would otherwise supply ``tuneplane.runner`` instead of the sealed copy.
_PACKAGE_INIT = b'"""TunePlane\'s runner and its metrics SDK, sealed into a Job Capsule."""\n'
_MAIN = (
    b'"""Run the sealed runner: ``python runner.pyz <member_dir>``."""\n\n'
    b"from tuneplane.runner.main import main\n\n"
    b"raise SystemExit(main())\n"
)
_PACKAGES = (("tuneplane.runner", "tuneplane/runner"), ("tuneplane.report", "tuneplane/report"))
# The entries that also get a ``.pyc``: what the runner process executes, never the SDK.
_COMPILED = ("__main__.py", "tuneplane/runner/")
# PEP 552 flags: bit 0 set, hash-based; bit 1 clear, the source is not checked on import.
_UNCHECKED_HASH_PYC = 0b01
#: The marshal format of the bytecode: the last without references (see :func:`_pyc`).
_MARSHAL_FORMAT = 2


class RunnerPyzError(Exception):
    """The runner cannot be built, written or verified; ``str()`` names the file and the fix."""


def capsule_dir(member_dir: Path) -> Path:
    """``<member_dir>/work/.tuneplane/capsule``: where Prepare puts the Job Capsule."""
    return member_dir / WORK_DIR / CAPSULE_DIR


def _package_sources(package: str) -> list[Path]:
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise RunnerPyzError(
            f"The package {package} is not installed next to this agent, so runner.pyz cannot "
            f"be built; reinstall TunePlane on this Node."
        )
    return sorted(Path(locations[0]).glob("*.py"))


def _pyc(name: str, source: bytes, origin: Path | None) -> bytes:
    """``source`` as an unchecked hash-based pyc of this interpreter, as zipimport reads it.

    The code names ``runner.pyz/<name>`` as its file: the capsule's path is not known here and
    must not change the bytes; a traceback still shows each line, read from the ``.py`` kept in
    the zip. ``optimize=0``: the bytes never follow the agent's own ``-O``; the runner is started
    without it.
    """
    try:
        code = compile(source, f"{RUNNER_PYZ}/{name}", "exec", dont_inherit=True, optimize=0)
    except (SyntaxError, ValueError) as exc:
        raise RunnerPyzError(
            f"The runner source {origin or name} does not compile ({exc}), so runner.pyz cannot "
            f"be built; reinstall TunePlane on this Node."
        ) from None
    flags = _UNCHECKED_HASH_PYC.to_bytes(4, "little")
    source_hash = importlib.util.source_hash(source)
    # Marshal format 2: from format 3 on, marshal writes an object shared by reference when its
    # reference count is above one, a count that can depend on what else the process holds
    # (CPython's reproducible-build reports name it); without references it cannot.
    return importlib.util.MAGIC_NUMBER + flags + source_hash + marshal.dumps(code, _MARSHAL_FORMAT)


@functools.cache
def build() -> bytes:
    """The deterministic ``runner.pyz`` bytes of the installed ``tuneplane.runner``/``report``.

    Cached: the installed sources are read (and the runner's compiled) once per agent process.
    """
    entries = {"__main__.py": _MAIN, "tuneplane/__init__.py": _PACKAGE_INIT}
    origins: dict[str, Path] = {}
    for package, prefix in _PACKAGES:
        for source in _package_sources(package):
            name = f"{prefix}/{source.name}"
            entries[name] = source.read_bytes()
            origins[name] = source
    for name in [name for name in entries if name.startswith(_COMPILED)]:
        entries[f"{name}c"] = _pyc(name, entries[name], origins.get(name))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name in sorted(entries):
            info = zipfile.ZipInfo(name, date_time=_FIXED_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = _FILE_MODE << 16
            archive.writestr(info, entries[name], compresslevel=9)
    return buffer.getvalue()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@functools.cache
def own_digest() -> str:
    """The sha256 (hex) of :func:`build`: this Node's runner, as Prepare seals it."""
    return _sha256(build())


def materialise(capsule: Path, dir_sync: DirSync | None = None) -> str:
    """Write ``runner.pyz`` and ``runner.sha256`` into ``capsule``; return the sha256 (hex).
    With ``dir_sync``, ``capsule`` is fsynced at its flush (the caller's Prepare), not here.

    Idempotent: a second Prepare writes the same bytes again. A file already there with other
    bytes (edited, or left by an older runner) is replaced and the replacement is logged. The
    written file is read back and must match, or :class:`RunnerPyzError` is raised.
    """
    data = build()
    digest = own_digest()
    path = capsule / RUNNER_PYZ
    capsule.mkdir(parents=True, exist_ok=True)
    try:
        found = _sha256(path.read_bytes())
    except FileNotFoundError:
        found = None
    if found is not None and found != digest:
        log.warning("runner replaced path=%s found_sha256=%s sha256=%s", path, found, digest)
    write_atomic(path, data, 0o644, dir_sync=dir_sync)
    written = _sha256(path.read_bytes())
    if written != digest:
        raise RunnerPyzError(
            f"The runner {path} reads back with sha256 {written} instead of {digest} after "
            f"writing; check the disk under {capsule} and prepare the member again."
        )
    write_atomic(capsule / RUNNER_DIGEST, f"{digest}\n".encode(), 0o644, dir_sync=dir_sync)
    return digest


def recorded(capsule: Path) -> str:
    """The sha256 (hex) Prepare recorded for the capsule's runner in ``runner.sha256``."""
    return (capsule / RUNNER_DIGEST).read_text().strip()


def verified(capsule: Path) -> tuple[Path, str]:
    """The absolute path of ``capsule``/``runner.pyz``, checked against ``runner.sha256``, and
    that sha256.

    Raises :class:`RunnerPyzError` when either file is missing or the digests differ, so a
    runner changed after Prepare is never started.
    """
    path = capsule / RUNNER_PYZ
    try:
        expected = recorded(capsule)
        actual = _sha256(path.read_bytes())
    except FileNotFoundError as exc:
        raise RunnerPyzError(
            f"The Job Capsule {capsule} has no {Path(str(exc.filename)).name}; Prepare writes "
            f"{RUNNER_PYZ} and {RUNNER_DIGEST}, so prepare the member again."
        ) from None
    if actual != expected:
        raise RunnerPyzError(
            f"The runner {path} has sha256 {actual} but Prepare recorded {expected} in "
            f"{RUNNER_DIGEST}; it changed after Prepare, so it is not started. Prepare the "
            f"member again to rewrite it."
        )
    return path.absolute(), actual
