"""``tuneplane.report`` in real subprocesses: stdlib only, one file per rank, read back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import tuneplane.report
from tuneplane.collector.files import read_file

SDK = Path(tuneplane.report.__file__)


def workload(tmp_path: Path, script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run ``script`` as a workload does: a bare interpreter (no site-packages, so nothing
    installed) with only the SDK on PYTHONPATH, as the runner provides it."""
    lib = tmp_path / "capsule-lib"
    if not lib.exists():
        (lib / "tuneplane" / "report").mkdir(parents=True)
        shutil.copy(SDK, lib / "tuneplane" / "report" / "__init__.py")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TUNEPLANE_", "RANK"))}
    return subprocess.run(
        [sys.executable, "-S", "-c", textwrap.dedent(script)],
        env={**clean, "PYTHONPATH": str(lib), **env},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )


TRAIN = """
    import os
    from tuneplane.report import finish, init, log

    init({"lr": 0.001, "model": "tiny"})
    rank = int(os.environ.get("RANK", "0"))
    for step in range(5):
        if rank == 0:
            log({"train/loss": 1.0 / (step + 1), "train/tokens": step * 128})
    finish()
"""


def test_ranks_write_their_own_files_and_the_collector_reads_them(tmp_path: Path) -> None:
    telemetry = tmp_path / "telemetry"
    for rank in ("0", "1"):
        done = workload(tmp_path, TRAIN, {"RANK": rank, "TUNEPLANE_TELEMETRY_DIR": str(telemetry)})
        assert done.returncode == 0, done.stderr
    # Only rank 0 logged; rank 1 left no empty file behind.
    assert sorted(p.name for p in telemetry.iterdir()) == ["report.rank0.jsonl"]
    lines = (telemetry / "report.rank0.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["hparams"] == {"lr": 0.001, "model": "tiny"}
    assert len(lines) == 6
    points, warnings = read_file(telemetry / "report.rank0.jsonl", "report.rank0.jsonl")
    assert warnings == []
    assert [(p.tag, p.step, p.value) for p in points][:3] == [
        ("train/loss", 0, 1.0),
        ("train/tokens", 0, 0.0),
        ("train/loss", 1, 0.5),
    ]
    assert len(points) == 10
    assert all(p.wall_time is not None for p in points)


def test_directory_falls_back_to_out_dir_then_working_directory(tmp_path: Path) -> None:
    script = "from tuneplane.report import log\nlog({'x': 1}, step=3)\n"
    out_dir = tmp_path / "out"
    assert workload(tmp_path, script, {"TUNEPLANE_OUT_DIR": str(out_dir)}).returncode == 0
    assert (out_dir / "telemetry" / "report.rank0.jsonl").exists()
    assert workload(tmp_path, script, {"RANK": "3"}).returncode == 0
    written = (tmp_path / "tuneplane-telemetry" / "report.rank3.jsonl").read_text()
    assert json.loads(written)["step"] == 3


def test_bad_values_are_clear_errors_and_write_nothing(tmp_path: Path) -> None:
    script = """
        from tuneplane.report import ReportError, init, log
        init(dir="t")
        for bad in ({"loss": "0.5"}, {"loss": True}, {"loss": None}, {"": 1.0}, [1.0]):
            try:
                log(bad)
            except ReportError as exc:
                print(exc)
            else:
                raise SystemExit("accepted " + repr(bad))
        try:
            log({"loss": 1.0}, step=1.5)
        except ReportError as exc:
            print(exc)
        log({"loss": float("nan"), "ok": 2})
        try:
            init({"lr": 1})
            init({"lr": 2})
        except ReportError as exc:
            print(exc)
        try:
            init({"fn": object()})
        except ReportError as exc:
            print(exc)
    """
    done = workload(tmp_path, script, {})
    assert done.returncode == 0, done.stderr
    messages = done.stdout.splitlines()
    assert "metric 'loss' is '0.5' (str), not a number" in messages[0]
    assert "metric 'loss' is True (bool)" in messages[1]
    assert "metric 'loss' is a NoneType, not a number" in messages[2]
    assert "metric tag '' is not a non-empty string" in messages[3]
    assert "log() takes a mapping" in messages[4]
    assert "step is 1.5" in messages[5]
    assert "already called with different hparams" in messages[6]
    assert "hparams cannot be written as JSON" in messages[7]
    lines = [
        json.loads(x) for x in (tmp_path / "t" / "report.rank0.jsonl").read_text().splitlines()
    ]
    # One good line (NaN kept, written as JSON's NaN), then the hparams once.
    assert [sorted(x) for x in lines] == [
        ["metrics", "step", "wall_time"],
        ["hparams", "wall_time"],
    ]
    assert lines[0]["step"] == 0 and lines[0]["metrics"]["ok"] == 2.0


def test_threads_and_processes_never_interleave_lines(tmp_path: Path) -> None:
    script = """
        import os, threading
        from tuneplane.report import finish, init, log
        init(dir="t")
        def spam(tag):
            for step in range(300):
                log({tag: float(step), "pad" + "x" * 2000: 0.0}, step=step)
        threads = [threading.Thread(target=spam, args=(f"t{i}",)) for i in range(4)]
        pid = os.fork()
        for t in threads: t.start()
        for t in threads: t.join()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        finish()
    """
    done = workload(tmp_path, script, {})
    assert done.returncode == 0, done.stderr
    path = tmp_path / "t" / "report.rank0.jsonl"
    points, warnings = read_file(path, path.name)
    assert warnings == []
    assert len(points) == 2 * 4 * 300 * 2


@pytest.mark.parametrize("rank", ["x", "-1"])
def test_a_bad_rank_is_named(tmp_path: Path, rank: str) -> None:
    done = workload(tmp_path, "from tuneplane.report import log\nlog({'a': 1})\n", {"RANK": rank})
    assert done.returncode == 1
    assert "environment variable RANK" in done.stderr
