"""Crashes around ``--init-from``, as a power cut leaves them (the agent exits 137 at a named
point, no cleanup): after a member's manifest is written but before its exit is journaled, and
in the middle of copying a Derivation's source at Prepare. After a restart the manifest is
reported as written, and the half-made copy is never what a member sees: the attempt is aborted
and a retry copies and verifies again from scratch."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from tests.agent.jobs import job, tp, wait_job
from tests.faults.jobs import project, submit
from tests.support.agent import AgentProcess, start_agent, wait_until
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tuneplane.agent.init_from import INIT_FROM_DIR
from tuneplane.proto.contract.derivation_source import manifest_path

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WRITE = """set -eu
mkdir -p "$TUNEPLANE_OUT_DIR/ckpt"
head -c 1500000 /dev/urandom > "$TUNEPLANE_OUT_DIR/ckpt/a.bin"
head -c 1500000 /dev/urandom > "$TUNEPLANE_OUT_DIR/ckpt/b.bin"
"""
READ = """set -eu
cd "$TUNEPLANE_INIT_FROM_DIR"
sha256sum ckpt/a.bin ckpt/b.bin > "$TUNEPLANE_OUT_DIR/seen.txt"
"""


def _crash_at(agent: AgentProcess, point: str) -> None:
    assert agent.wait_exit(60) == 137
    assert f"point={point}" in agent.read_log()


def _shared(coord: CoordinatorProcess, agent: AgentProcess) -> None:
    with open(coord.state_dir / "coordinator.toml", "a", encoding="utf-8") as toml:
        toml.write(f'\n[fleet.default]\nshared_output_root = "{agent.out_root}"\n')
    coord.restart()


def test_crashes_while_writing_a_manifest_and_while_copying_a_source_are_survived(
    tmp_path: Path,
) -> None:
    with start_coordinator(tmp_path) as coord:
        agent = start_agent(
            tmp_path,
            coord,
            "node-a",
            "h200:2",
            env={"TUNEPLANE_CRASHPOINT": "after-manifest-written"},
        )
        try:
            _shared(coord, agent)
            agent.wait_connected()
            # 1. The manifest is on disk, the exit is not journaled: replay writes it again (the
            # same bytes) and reports it with the exit.
            run_a = submit(
                coord,
                project(coord, tmp_path / "a", "custom/custom", {"train.sh": WRITE}),
                "h200:1",
            )
            _crash_at(agent, "after-manifest-written")
            agent.restart()
            view = wait_job(coord, run_a, 120)
            assert view["state"] == "succeeded", view
            member = view["attempts"][-1]["members"][0]
            out_a = Path(member["out_dir"])
            manifest = Path(manifest_path(str(out_a))).read_bytes()
            assert member["output_manifest"]["sha256"] == hashlib.sha256(manifest).hexdigest()
            assert member["output_manifest"]["files"] == 2

            # 2. The agent dies after copying the first file: only a .partial folder exists.
            agent.restart(env={"TUNEPLANE_CRASHPOINT": "during-init-from-copy"})
            agent.wait_connected()
            proj_b = project(coord, tmp_path / "b", "custom/custom", {"train.sh": READ})
            run_b = submit(coord, proj_b, "h200:1", "--init-from", run_a)
            _crash_at(agent, "during-init-from-copy")
            dest = agent.work_root / f"{run_b}.1.0" / INIT_FROM_DIR
            assert dest.with_name(dest.name + ".partial").is_dir()
            assert not dest.exists()
            agent.restart()
            view = wait_job(coord, run_b, 120)
            assert view["state"] == "aborted", view
            assert "the agent stopped while preparing this member" in json.dumps(view)

            # 3. A retry is a new attempt: a fresh copy, verified, and the member reads A's bytes.
            tp(coord, "job", "retry", run_b)

            def retried() -> dict[str, Any] | None:
                current = job(coord, run_b)
                done = len(current["attempts"]) == 2 and current["state"] == "succeeded"
                return current if done else None

            final: dict[str, Any] = wait_until("the retried run to succeed", retried, 120)
            out_b = Path(final["attempts"][-1]["members"][0]["out_dir"])
            seen = (out_b / "seen.txt").read_text().split()
            expected = [
                hashlib.sha256((out_a / "ckpt" / n).read_bytes()).hexdigest()
                for n in ("a.bin", "b.bin")
            ]
            assert seen == [expected[0], "ckpt/a.bin", expected[1], "ckpt/b.bin"]
        finally:
            agent.stop()
