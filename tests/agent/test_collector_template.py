"""The collector template with real processes: a collector forked from it is the collector the
agent would start itself (same output, same exit code); a cancelled one gets SIGTERM and
stops; a template killed takes its collectors with it and the next start gets a new one; an
idle template ends; one that cannot start leaves the start to the caller."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import psutil
import pytest
import trio

from tuneplane.agent.collector_template import CollectorTemplate
from tuneplane.collector.service import LOCK_FILE
from tuneplane.collector.template import COLLECTOR_NAME
from tuneplane.coordinator.server.tls import create_dev_ca

WAIT_S = 60


@asynccontextmanager
async def _template(**kwargs: object) -> AsyncIterator[CollectorTemplate]:
    template = CollectorTemplate(**kwargs)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(template.run)
        yield template
        nursery.cancel_scope.cancel()


def _collector_args(root: Path) -> list[str]:
    """A real ``run`` that follows an empty directory until stopped (its gateway refuses)."""
    paths = create_dev_ca(root / "ca", ["localhost"])
    (root / "telemetry").mkdir()
    (root / "credential").write_text("tpc_not-a-real-credential\n")
    return [
        "run", "--telemetry-dir", str(root / "telemetry"), "--state-dir", str(root / "state"),
        "--gateway", "127.0.0.1:1", "--ca", str(paths.ca_cert),
        "--credential-file", str(root / "credential"),
        "--run-id", "run-000000000000", "--attempt", "1", "--member", "0",
    ]  # fmt: skip


async def _wait(what: str, check: Callable[[], object]) -> None:
    with trio.move_on_after(WAIT_S):
        while not check():
            await trio.sleep(0.05)
        return
    raise AssertionError(f"timed out after {WAIT_S} s waiting for {what}")


def _forked(template: CollectorTemplate) -> list[psutil.Process]:
    assert template.process is not None
    return psutil.Process(template.process.pid).children()


async def test_a_forked_collector_says_and_exits_as_one_started_itself(tmp_path: Path) -> None:
    program = str(Path(sys.executable).parent / "tuneplane-collector")
    for args in (["run", "--help"], ["follow-nothing"], ["run", "--telemetry-dir", "/nonexistent"]):
        direct = await trio.run_process(
            [program, *args], capture_stdout=True, capture_stderr=True, check=False
        )
        out = tmp_path / "out.log"
        async with _template() as template:
            with out.open("wb") as f:
                code = await template.run_collector(args, f.fileno())
        assert code == direct.returncode, args
        assert out.read_bytes() == direct.stdout + direct.stderr, args


async def test_a_cancelled_collector_gets_sigterm_and_stops(tmp_path: Path) -> None:
    args = _collector_args(tmp_path)
    out = tmp_path / "collector.log"
    async with _template() as template:
        with out.open("wb") as f, trio.CancelScope() as scope:

            async def cancel_once_running() -> None:
                # Its first try to ship: its SIGTERM handler is in place by then.
                await _wait("the collector to run", lambda: "ship failed" in out.read_text())
                (child,) = _forked(template)
                assert child.name() == COLLECTOR_NAME
                running.append(child)
                scope.cancel()

            running: list[psutil.Process] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancel_once_running)
                await template.run_collector(args, f.fileno())
        assert scope.cancelled_caught
        (child,) = running
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
        # SIGTERM, not SIGKILL: the collector said it was stopping, as it does on SIGTERM.
        assert "collector stopping signal=SIGTERM" in out.read_text()
        assert template.process is not None and template.process.returncode is None


async def test_a_killed_template_takes_its_collectors_and_the_next_start_gets_a_new_one(
    tmp_path: Path,
) -> None:
    args = _collector_args(tmp_path)
    async with _template() as template:
        template.warm()
        await _wait("the template", lambda: template.process is not None)
        first = template.process
        assert first is not None
        codes: list[int | None] = []

        async def run_one() -> None:
            with (tmp_path / "collector.log").open("wb") as f:
                codes.append(await template.run_collector(args, f.fileno()))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_one)
            await _wait("the collector's lock", (tmp_path / "state" / LOCK_FILE).exists)
            (child,) = _forked(template)
            os.kill(first.pid, signal.SIGKILL)
        assert codes == [-signal.SIGKILL]
        # The parent-death signal: no collector is left running unseen by the agent.
        child.wait(timeout=WAIT_S)
        with (tmp_path / "again.log").open("wb") as f:
            assert await template.run_collector(["run", "--help"], f.fileno()) == 0
        assert template.process is not None and template.process.pid != first.pid


async def test_an_idle_template_ends_and_ending_the_agent_ends_it(tmp_path: Path) -> None:
    async with _template(idle_s=0.5) as template:
        template.warm()
        await _wait("the template", lambda: template.process is not None)
        idle = psutil.Process(template.process.pid)  # type: ignore[union-attr]
        await _wait("the idle template to end", lambda: not idle.is_running())
        assert template.process is None
    async with _template() as template:
        template.warm()
        await _wait("the template", lambda: template.process is not None)
        process = template.process
    # Cancelled with its owner: EOF on its socket, and it is gone.
    assert process is not None and process.returncode == 0


async def test_a_template_that_cannot_start_leaves_the_start_to_the_caller(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with _template(python=str(tmp_path / "no-such-python")) as template:
        with (tmp_path / "out.log").open("wb") as f:
            assert await template.run_collector(["run", "--help"], f.fileno()) is None
    assert "collector template not started" in caplog.text
