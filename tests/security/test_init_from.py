"""``--init-from`` tried as an attacker would, against a real coordinator with a real Node whose
output root is the Fleet's shared output root: another user's run, a failed run, a run that does
not exist and a source sent with the intent are each refused at Preview with a sentence naming
the run, and nothing is stored (no preview, no Job). A workload cannot read another run's
output manifest or outputs."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from grpclib.exceptions import GRPCError

from tests.agent.jobs import job, wait_job
from tests.coordinator.grpc_client import api_client, job_ids, jobspec
from tests.faults.jobs import project, submit
from tests.support.accounts import require_root
from tests.support.agent import start_agent
from tests.support.coordinator import CoordinatorProcess, start_coordinator

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@attrs.frozen
class World:
    coord: CoordinatorProcess
    bob: str  # a user token
    succeeded: str  # the admin's run, succeeded, with a manifest under the shared root
    failed: str  # the admin's run that exited 3


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("initfrom-attack")
    with start_coordinator(root) as coord:
        agent = start_agent(root, coord, "node-a", "h200:2")
        try:
            with open(coord.state_dir / "coordinator.toml", "a", encoding="utf-8") as toml:
                toml.write(f'\n[fleet.default]\nshared_output_root = "{agent.out_root}"\n')
            coord.restart()
            agent.wait_connected()
            good = project(coord, root / "good", "custom/custom",
                           {"train.sh": 'echo w > "$TUNEPLANE_OUT_DIR/w.bin"\n'})  # fmt: skip
            bad = project(coord, root / "bad", "custom/custom", {"train.sh": "exit 3\n"})
            succeeded = submit(coord, good, "h200:1")
            failed = submit(coord, bad, "h200:1")
            assert wait_job(coord, succeeded, 120)["state"] == "succeeded"
            assert wait_job(coord, failed, 120)["state"] == "failed"
            yield World(coord, coord.create_user("bob"), succeeded, failed)
        finally:
            agent.stop()


def _stored(coord: CoordinatorProcess) -> tuple[int, list[str]]:
    with sqlite3.connect(coord.state_dir / "coordinator.db", timeout=10) as db:
        previews: int = db.execute("SELECT count(*) FROM previews").fetchone()[0]
    return previews, sorted(asyncio.run(job_ids(coord)))


def _preview(coord: CoordinatorProcess, token: str, spec: dict[str, Any]) -> str:
    """Preview ``spec`` as ``token``'s user; the refusal's message (the call must be refused)."""

    async def call() -> str:
        async with api_client(coord.api, coord.ca_path, token) as api:
            try:
                reply = await api.preview(spec)
            except GRPCError as exc:
                return str(exc.message)
            raise AssertionError(f"the Preview was accepted: {reply.preview_id}")

    return asyncio.run(call())


def _refused(world: World, token: str, spec: dict[str, Any]) -> str:
    before = _stored(world.coord)
    message = _preview(world.coord, token, spec)
    assert _stored(world.coord) == before, "a refused Preview stored something"
    return message


def test_another_users_run_is_refused_and_nothing_is_stored(world: World) -> None:
    said = _refused(world, world.bob, {**jobspec(gpus=1), "init_from": world.succeeded})
    assert f"the run {world.succeeded} belongs to admin and is not shared with you" in said
    # The owner may begin from it: the same spec is accepted for the admin.
    accepted = asyncio.run(_accepted(world, {**jobspec(gpus=1), "init_from": world.succeeded}))
    assert world.succeeded in accepted and "manifest_sha256" in accepted


async def _accepted(world: World, spec: dict[str, Any]) -> str:
    async with api_client(world.coord.api, world.coord.ca_path, world.coord.admin_token) as api:
        return (await api.preview(spec)).resolved_jobspec_json


def test_a_failed_run_and_an_unknown_run_are_refused(world: World) -> None:
    token = world.coord.admin_token
    said = _refused(world, token, {**jobspec(gpus=1), "init_from": world.failed})
    assert f"the run {world.failed} is failed, and only a succeeded run's outputs" in said
    said = _refused(world, world.bob, {**jobspec(gpus=1), "init_from": "run-000000000000"})
    assert "there is no run run-000000000000" in said


def test_a_source_sent_with_the_intent_is_refused(world: World) -> None:
    # What the coordinator would resolve, but pointing at another directory: never taken.
    forged = {
        "run_id": world.succeeded,
        "attempt": 1,
        "member_index": 0,
        "out_dir": "/etc",
        "manifest_sha256": "0" * 64,
        "files": 1,
        "bytes": 1,
    }
    spec = {**jobspec(gpus=1), "init_from": world.succeeded, "init_from_source": forged}
    for token in (world.bob, world.coord.admin_token):
        said = _refused(world, token, spec)
        assert "init_from_source" in said
        assert "is computed by the coordinator at Preview, not sent with the intent" in said


# Reads what it is pointed at and records what the kernel said.
PEEK = """log="$TUNEPLANE_OUT_DIR/peek.txt"
for f in "$PEEK_MANIFEST" "$PEEK_FILE"; do
  if cat "$f" > /dev/null 2>> "$log"; then echo "READ $f" >> "$log"; fi
done
"""


def test_a_workload_cannot_read_another_runs_manifest_or_outputs(
    world: World, tmp_path: Path
) -> None:
    require_root()
    coord = world.coord
    out_dir = job(coord, world.succeeded)["attempts"][-1]["members"][0]["out_dir"]
    proj = project(coord, tmp_path / "peek", "custom/custom", {"train.sh": PEEK})
    run_id = submit(
        coord, proj, "h200:1", "--env", f"PEEK_MANIFEST={out_dir}.manifest.json",
        "--env", f"PEEK_FILE={out_dir}/w.bin",
    )  # fmt: skip
    view = wait_job(coord, run_id, 120)
    assert view["state"] == "succeeded", view
    peek = (Path(view["attempts"][-1]["members"][0]["out_dir"]) / "peek.txt").read_text()
    assert "READ" not in peek, peek
    assert peek.count("Permission denied") == 2, peek
