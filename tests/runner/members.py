"""Build real member directories with small Python workloads, and wait on what runners do."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import trio

from tuneplane.agent import runner_pyz
from tuneplane.agent.launch_plan import ProcessSpec, plan_processes
from tuneplane.agent.supervision import MemberLaunch, Observation, observe, write_launch

# A workload that waits for a file the test creates, so "still running" is never a race.
WAIT_FOR_RELEASE = """
import os, sys, time
release = os.path.join(os.environ["TUNEPLANE_OUT_DIR"], "release")
deadline = time.monotonic() + 60
while not os.path.exists(release):
    if time.monotonic() > deadline:
        sys.exit(99)
    time.sleep(0.02)
"""


def workload(directory: Path, name: str, source: str) -> Path:
    """Write ``source`` as a Python script and return its path."""
    path = directory / name
    path.write_text(textwrap.dedent(source))
    return path


def member_launch(
    tmp_path: Path,
    argvs: list[list[str]] | None = None,
    *,
    specs: tuple[ProcessSpec, ...] | None = None,
    grace_period_s: int = 5,
    name: str = "r-1.1.0",
) -> MemberLaunch:
    """A :class:`MemberLaunch` under ``tmp_path`` running ``argvs`` (one process each)."""
    member_dir = tmp_path / "members" / name
    out_dir = tmp_path / "outputs" / name
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    base = base_env(out_dir)
    if specs is None:
        assert argvs is not None
        specs = tuple(
            ProcessSpec(argv=tuple(argv), env=base, cwd=str(work), local_rank=rank)
            for rank, argv in enumerate(argvs)
        )
    return MemberLaunch(
        member_dir=member_dir,
        run_id="r-1",
        attempt=1,
        member_index=0,
        processes=specs,
        out_dir=out_dir,
        grace_period_s=grace_period_s,
        stdout_path=member_dir / "stdout.log",
        stderr_path=member_dir / "stderr.log",
    )


def base_env(out_dir: Path) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "TUNEPLANE_RUN_ID": "r-1",
        "TUNEPLANE_ATTEMPT": "1",
        "TUNEPLANE_OUT_DIR": str(out_dir),
    }


def python(script: Path, *args: str) -> list[str]:
    return [sys.executable, str(script), *args]


def prepared(launch: MemberLaunch) -> Path:
    """Write the launch and the capsule's ``runner.pyz`` as Prepare does; return the member dir."""
    runner_pyz.materialise(runner_pyz.capsule_dir(launch.member_dir))
    write_launch(launch)
    return launch.member_dir


def process_group_specs(
    tmp_path: Path, script: Path, gpus: tuple[str, ...], member_index: int, member_count: int
) -> tuple[ProcessSpec, ...]:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return plan_processes(
        launcher="process-group",
        entrypoint=(sys.executable, str(script)),
        gpu_uuids=gpus,
        member_index=member_index,
        member_count=member_count,
        master_addr="127.0.0.1",
        master_port=29511,
        base_env=base_env(tmp_path / "outputs" / "r-1.1.0"),
        cwd=work,
    )


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 20.0) -> None:
    """Poll ``predicate`` on real time; fail the test with a clear message after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await trio.sleep(0.02)


async def wait_observation(member_dir: Path, kind: type, timeout_s: float = 20.0) -> Observation:
    """Poll :func:`observe` until it returns a ``kind``; return that observation."""
    await wait_until(lambda: isinstance(observe(member_dir), kind), timeout_s)
    return observe(member_dir)


def read_env_dump(path: Path) -> Mapping[str, str]:
    value: dict[str, str] = json.loads(path.read_text())
    return value
