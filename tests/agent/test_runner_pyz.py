"""The capsule's runner.pyz: deterministic bytes, a recorded digest; only a verified one runs.

The runner's modules ship as bytecode too: a real runner starts from its ``.pyc`` entries (its
``.py`` sources replaced by code that cannot run still start the member), and bytecode of another
interpreter falls back to the sources.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

import tuneplane.report
import tuneplane.runner
from tests.runner.members import (
    WAIT_FOR_RELEASE,
    member_launch,
    prepared,
    python,
    wait_observation,
    workload,
)
from tuneplane.agent import runner_pyz
from tuneplane.agent.prepare import PrepareRefused, materialise
from tuneplane.agent.runner_pyz import RUNNER_DIGEST, RUNNER_PYZ, capsule_dir
from tuneplane.agent.supervision import (
    Exited,
    NotStarted,
    RunnerNotVerified,
    Running,
    observe,
    start_runner,
    write_launch,
)
from tuneplane.runner.records import CLAIM_FILE


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_the_same_installed_runner_always_gives_the_same_bytes() -> None:
    first = runner_pyz.build()
    runner_pyz.build.cache_clear()
    second = runner_pyz.build()
    assert first == second
    with zipfile.ZipFile(io.BytesIO(first)) as archive:
        infos = archive.infolist()
        names = [info.filename for info in infos]
        assert names == sorted(names)
        assert {info.date_time for info in infos} == {(1980, 1, 1, 0, 0, 0)}
        assert {"__main__.py", "tuneplane/__init__.py"} <= set(names)
        runner_dir = Path(tuneplane.runner.__file__).parent
        for source in sorted(runner_dir.glob("*.py")):
            assert archive.read(f"tuneplane/runner/{source.name}") == source.read_bytes()
        report = Path(tuneplane.report.__file__)
        assert archive.read("tuneplane/report/__init__.py") == report.read_bytes()


def test_prepare_writes_runner_pyz_with_its_recorded_digest(tmp_path: Path) -> None:
    work = materialise(tmp_path / "m", "{}", {}, {}, {})
    capsule = capsule_dir(tmp_path / "m")
    assert work / ".tuneplane" / "capsule" == capsule
    data = (capsule / RUNNER_PYZ).read_bytes()
    assert data == runner_pyz.build()
    assert (capsule / RUNNER_DIGEST).read_text() == f"{sha(data)}\n"
    assert runner_pyz.recorded(capsule) == sha(data)
    assert runner_pyz.verified(capsule) == ((capsule / RUNNER_PYZ).absolute(), sha(data))


def test_a_second_prepare_rewrites_a_runner_that_changed(tmp_path: Path) -> None:
    capsule = capsule_dir(tmp_path / "m")
    digest = runner_pyz.materialise(capsule)
    (capsule / RUNNER_PYZ).write_bytes(b"not the runner")
    (capsule / RUNNER_DIGEST).write_text(f"{sha(b'not the runner')}\n")
    assert runner_pyz.materialise(capsule) == digest
    assert (capsule / RUNNER_PYZ).read_bytes() == runner_pyz.build()
    assert runner_pyz.recorded(capsule) == digest


def test_the_coordinator_cannot_seal_a_file_named_like_the_runner(tmp_path: Path) -> None:
    data = b"print('hijack')"
    with pytest.raises(PrepareRefused, match=r"runner\.pyz is a name the Node writes itself"):
        materialise(tmp_path / "m", "{}", {RUNNER_PYZ: data}, {RUNNER_PYZ: sha(data)}, {})


def test_a_capsule_without_its_digest_file_is_not_verified(tmp_path: Path) -> None:
    capsule = capsule_dir(tmp_path / "m")
    runner_pyz.materialise(capsule)
    (capsule / RUNNER_DIGEST).unlink()
    with pytest.raises(runner_pyz.RunnerPyzError, match=r"has no runner\.sha256"):
        runner_pyz.verified(capsule)


async def test_the_running_runner_is_the_capsules_runner_pyz(tmp_path: Path) -> None:
    script = workload(tmp_path, "w.py", WAIT_FOR_RELEASE)
    launch = member_launch(tmp_path, [python(script)])
    member_dir = prepared(launch)
    running = await start_runner(member_dir)
    assert isinstance(running, Running)
    runner_file = str((capsule_dir(member_dir) / RUNNER_PYZ).absolute())
    assert runner_file in psutil.Process(running.pid).cmdline()
    (launch.out_dir / "release").touch()
    result = await wait_observation(member_dir, Exited)
    assert (result.exit_code, result.signal) == (0, None)  # type: ignore[union-attr]


async def test_a_runner_changed_after_prepare_is_never_started(tmp_path: Path) -> None:
    script = workload(tmp_path, "w.py", "print('must not run')")
    launch = member_launch(tmp_path, [python(script)])
    member_dir = prepared(launch)
    runner = capsule_dir(member_dir) / RUNNER_PYZ
    tampered = bytearray(runner.read_bytes())
    tampered[len(tampered) // 2] ^= 0xFF
    runner.write_bytes(bytes(tampered))
    with pytest.raises(RunnerNotVerified, match="it changed after Prepare"):
        await start_runner(member_dir)
    assert isinstance(observe(member_dir), NotStarted)
    assert not (member_dir / CLAIM_FILE).exists()
    # Prepare again rewrites the runner, and then the member starts.
    runner_pyz.materialise(capsule_dir(member_dir))
    write_launch(launch)
    await start_runner(member_dir)
    result = await wait_observation(member_dir, Exited)
    assert (result.exit_code, result.signal) == (0, None)  # type: ignore[union-attr]


# Prints where the runner's main module came from, as zipimport records it in ``__file__``.
WHERE_MAIN_LOADS_FROM = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "import tuneplane.runner.main as m; print(m.__file__)"
)
# Each runner source in a copy of the zip becomes this: importing it from source fails.
NOT_THE_SOURCE = b'raise SystemExit("the source of a runner module ran instead of its .pyc")\n'


def compiled(name: str) -> bool:
    """The entries the runner executes: ``__main__`` and ``tuneplane.runner``, never the SDK."""
    return name == "__main__.py" or name.startswith("tuneplane/runner/")


def rewritten(data: bytes, change: Callable[[str, bytes], bytes]) -> bytes:
    """A copy of the zip ``data`` with each entry's bytes passed through ``change``."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as source, zipfile.ZipFile(buffer, "w") as copy:
        for info in source.infolist():
            copy.writestr(info, change(info.filename, source.read(info)))
    return buffer.getvalue()


def seal(member_dir: Path, data: bytes) -> Path:
    """Put ``data`` in the member's capsule as its runner with its digest, as Prepare records it."""
    capsule = capsule_dir(member_dir)
    (capsule / RUNNER_PYZ).write_bytes(data)
    (capsule / RUNNER_DIGEST).write_text(f"{sha(data)}\n")
    return capsule / RUNNER_PYZ


def main_loads_from(pyz: Path) -> str:
    probe = subprocess.run(
        [sys.executable, "-c", WHERE_MAIN_LOADS_FROM, str(pyz)],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return probe.stdout.strip()


def test_another_agent_process_builds_the_same_bytes() -> None:
    # Other hash seeds, and a process that already imported the runner (other refcounts).
    code = (
        "import hashlib, sys, tuneplane.runner.main\n"
        "from tuneplane.agent.runner_pyz import build\n"
        "sys.stdout.write(hashlib.sha256(build()).hexdigest())\n"
    )
    digests = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("0", "1", "2")
    }  # fmt: skip
    assert digests == {sha(runner_pyz.build())}


def test_every_runner_module_ships_as_an_unchecked_hash_pyc_of_this_interpreter() -> None:
    with zipfile.ZipFile(io.BytesIO(runner_pyz.build())) as archive:
        names = set(archive.namelist())
        sources = {name for name in names if name.endswith(".py")}
        assert {name for name in names if name.endswith(".pyc")} == {
            f"{name}c" for name in sources if compiled(name)
        }
        assert {"__main__.py", "tuneplane/runner/main.py", "tuneplane/runner/lifecycle.py"} <= {
            name for name in sources if compiled(name)
        }
        for name in sorted(sources):
            if compiled(name):
                pyc = archive.read(f"{name}c")
                assert pyc[:4] == importlib.util.MAGIC_NUMBER
                assert int.from_bytes(pyc[4:8], "little") == 0b01
                assert pyc[8:16] == importlib.util.source_hash(archive.read(name))


async def test_the_runner_starts_the_member_from_its_bytecode(tmp_path: Path) -> None:
    script = workload(tmp_path, "w.py", WAIT_FOR_RELEASE)
    launch = member_launch(tmp_path, [python(script)])
    member_dir = prepared(launch)
    pyz = capsule_dir(member_dir) / RUNNER_PYZ
    without_sources = rewritten(
        pyz.read_bytes(),
        lambda name, data: NOT_THE_SOURCE if name.endswith(".py") and compiled(name) else data,
    )
    seal(member_dir, without_sources)
    assert main_loads_from(pyz) == f"{pyz}/tuneplane/runner/main.pyc"
    running = await start_runner(member_dir)
    assert isinstance(running, Running)
    (launch.out_dir / "release").touch()
    result = await wait_observation(member_dir, Exited)
    assert (result.exit_code, result.signal) == (0, None)  # type: ignore[union-attr]


async def test_bytecode_of_another_interpreter_falls_back_to_the_sources(tmp_path: Path) -> None:
    script = workload(tmp_path, "w.py", "pass")
    member_dir = prepared(member_launch(tmp_path, [python(script)]))
    pyz = capsule_dir(member_dir) / RUNNER_PYZ
    other_magic = bytes([importlib.util.MAGIC_NUMBER[0] ^ 0xFF]) + importlib.util.MAGIC_NUMBER[1:]
    seal(
        member_dir,
        rewritten(
            pyz.read_bytes(),
            lambda name, data: other_magic + data[4:] if name.endswith(".pyc") else data,
        ),
    )
    assert main_loads_from(pyz) == f"{pyz}/tuneplane/runner/main.py"
    await start_runner(member_dir)
    result = await wait_observation(member_dir, Exited)
    assert (result.exit_code, result.signal) == (0, None)  # type: ignore[union-attr]
