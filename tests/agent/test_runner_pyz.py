"""The capsule's runner.pyz: deterministic bytes, a recorded digest; only a verified one runs."""

from __future__ import annotations

import hashlib
import io
import zipfile
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
    assert runner_pyz.verified(capsule) == (capsule / RUNNER_PYZ).absolute()


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
