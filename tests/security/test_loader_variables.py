"""Loader variables (``LD_*``, ``PYTHONPATH`` and their kin) reach a workload only where the
runtime allows them, at both ends (issue 8, must have 2), with real processes.

coordinator.toml's ``[runtimes."<runtime id>"] allow_loader_env`` decides at Preview and again
when the scheduler launches a stored JobSpec; the Node's node.toml ``[runtimes.<name>]
allow_loader_env`` has the final say at Prepare. Each refusal is a sentence naming the variable,
the runtime and the fix, and changes nothing else: no preview, no Job, no GPU held, no file.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from grpclib.const import Status

from tests.agent.jobs import journal, wait_job
from tests.coordinator.grpc_client import api_client, enroll, jobspec, node_stream
from tests.faults.jobs import held_gpus, project, submit
from tests.security.raw_calls import call
from tests.support.agent import start_agent
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tuneplane.proto import v1

PREVIEW = "/tuneplane.v1.Api/Preview"
ALLOW_BASH = '\n[runtimes."host:bash"]\nallow_loader_env = true\n'
# The Node's definition of host:bash; the test flips allow_loader_env between its phases.
NODE_BASH = '[runtimes.bash]\npath = "/usr/bin:/bin"\ninterpreter = "/usr/bin/bash"\n'
LIB = "/opt/tuneplane-test-lib"
MODULES = "/opt/tuneplane-test-modules"
# Records the workload's environment, one NAME=VALUE a line.
DUMPS_ENV = """\
touch "$TUNEPLANE_OUT_DIR/ran"
env > "$TUNEPLANE_OUT_DIR/env.txt"
"""


def _coordinator(root: Path, policy: str) -> CoordinatorProcess:
    """A coordinator whose coordinator.toml ends with ``policy``."""
    return start_coordinator(root, config=policy)


def _stored(coord: CoordinatorProcess) -> tuple[int, int]:
    """(previews, Jobs) in the coordinator's store."""
    with sqlite3.connect(coord.state_dir / "coordinator.db", timeout=10) as db:
        previews: int = db.execute("SELECT count(*) FROM previews").fetchone()[0]
        jobs: int = db.execute("SELECT count(*) FROM jobs").fetchone()[0]
    return previews, jobs


@pytest.fixture(scope="module")
def coord(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    with _coordinator(tmp_path_factory.mktemp("loader"), ALLOW_BASH) as c:
        yield c


def test_preview_allows_loader_variables_only_on_the_runtimes_coordinator_toml_names(
    coord: CoordinatorProcess,
) -> None:
    allowed = jobspec(gpus=0, profile="cpu")  # runtime_id "" is custom/custom's host:bash
    allowed["env"] = {"LD_LIBRARY_PATH": LIB, "SEED": "1"}
    refused = jobspec(gpus=0, profile="cpu", method_id="pytorch/process-group")
    refused["env"] = {"LD_LIBRARY_PATH": LIB, "SEED": "1"}

    async def scenario() -> tuple[v1.PreviewReply, tuple[int, int], tuple[int, int]]:
        async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
            reply = await api.preview(allowed)
            before = await anyio.to_thread.run_sync(_stored, coord)
            body = bytes(v1.PreviewRequest(jobspec_json=json.dumps(refused)))
            answer = await call(coord.api, coord.ca_path, PREVIEW, body, coord.admin_token)
            assert answer.status == Status.INVALID_ARGUMENT, answer
            assert answer.message == (
                f"JobSpec field 'env.LD_LIBRARY_PATH' = '{LIB}': is a loader variable: it "
                "changes which libraries or Python modules the workload loads, and the runtime "
                "host:python3 does not allow loader variables. Remove it from the env (put the "
                "libraries in the experiment), or ask the coordinator's operator to allow them "
                'with [runtimes."host:python3"] allow_loader_env = true in coordinator.toml '
                "(the Node's node.toml must allow them for that runtime too)."
            )
            return reply, before, await anyio.to_thread.run_sync(_stored, coord)

    reply, before, after = asyncio.run(scenario())
    resolved = json.loads(reply.resolved_jobspec_json)
    assert resolved["runtime_id"] == "host:bash"
    assert resolved["env"] == {"LD_LIBRARY_PATH": LIB, "SEED": "1"}
    # The refusal stored nothing (the allowed Preview created no Job either).
    assert after == before and before[1] == 0


def test_the_node_refuses_what_its_runtime_does_not_allow_and_runs_it_once_it_does(
    coord: CoordinatorProcess, tmp_path: Path
) -> None:
    agent = start_agent(
        tmp_path, coord, "node-a", "h200:2", node_toml=NODE_BASH + "allow_loader_env = false\n"
    )
    try:
        agent.wait_connected()
        root = project(coord, tmp_path / "p", "custom/custom", {"train.sh": DUMPS_ENV})
        token = agent.state_dir / "credentials" / "control.token"
        token_before = token.read_bytes()
        env_flags = ("--env", f"LD_LIBRARY_PATH={LIB}", "--env", f"PYTHONPATH={MODULES}")

        # coordinator.toml allows host:bash; this Node's node.toml does not: the Node refuses.
        run_id = submit(coord, root, "h200:1", *env_flags)
        done = wait_job(coord, run_id, 60)
        sentence = (
            "The Job's env.LD_LIBRARY_PATH is a loader variable: it changes which libraries or "
            "Python modules the workload loads, and the runtime host:bash does not allow loader "
            "variables. Remove it from the env (put the libraries in the experiment), or ask "
            "this Node's operator to set allow_loader_env = true under [runtimes.bash] in "
            "node.toml."
        )
        assert done["state"] == "aborted", done
        assert sentence in done["state_reason"], done
        (member,) = [m for m in journal(agent, "members", "--json") if m["run_id"] == run_id]
        assert member["state"] == "aborted" and member["reason"] == sentence
        # Nothing of the member exists or is held, and the Node is as it was.
        assert not (Path(member["out_dir"]) / "ran").exists()
        assert not (agent.work_root / member["member"]).exists()
        assert held_gpus(agent) == []
        assert token.read_bytes() == token_before
        assert agent.wait_connected()["connected"]

        # Once node.toml allows it too, the same Job runs with the variables in its env, and
        # the runner's own PYTHONPATH entry (the tuneplane.report SDK) stays first.
        agent.config_path.write_text(
            agent.config_path.read_text().replace(
                "allow_loader_env = false", "allow_loader_env = true"
            )
        )
        agent.restart()
        agent.wait_connected()
        run_id = submit(coord, root, "h200:1", *env_flags)
        done = wait_job(coord, run_id, 60)
        assert done["state"] == "succeeded", done
        (member,) = [m for m in journal(agent, "members", "--json") if m["run_id"] == run_id]
        lines = (Path(member["out_dir"]) / "env.txt").read_text().splitlines()
        env = dict(line.split("=", 1) for line in lines if "=" in line)
        assert env["LD_LIBRARY_PATH"] == LIB
        sdk, _, theirs = env["PYTHONPATH"].partition(":")
        assert theirs == MODULES and sdk and sdk != MODULES, env["PYTHONPATH"]
        assert held_gpus(agent) == []
    finally:
        agent.stop()


def test_a_policy_tightened_after_admission_holds_at_launch(tmp_path: Path) -> None:
    """A Job admitted while coordinator.toml allowed its loader variable, launched after the
    operator withdrew that: the scheduler re-checks the stored JobSpec and cancels the Job with
    the sentence; no Node is asked and no GPU is reserved."""
    with _coordinator(tmp_path, ALLOW_BASH) as coord:
        node = asyncio.run(enroll(coord.control, coord.ca_path, coord.create_join_token(), "n", 2))
        spec = jobspec(gpus=1, profile="h200")
        spec["env"] = {"LD_PRELOAD": "/opt/x.so"}

        async def admit() -> str:
            async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
                receipt = await api.submit(spec, "tightened")
                job = await api.job(receipt.run_id)
                assert job.state == "queued", job  # no Node is connected
                return receipt.run_id

        run_id = asyncio.run(admit())
        coord.stop()
        config = coord.state_dir / "coordinator.toml"
        config.write_text(config.read_text().replace(ALLOW_BASH, ""))
        coord.start(coord.ports())

        async def launch() -> v1.Job:
            async with (
                node_stream(coord.control, coord.ca_path, node.node_credential, node.node_id),
                api_client(coord.api, coord.ca_path, coord.admin_token) as api,
            ):
                return await api.wait_for_state(run_id, "cancelled", timeout=30)

        cancelled = asyncio.run(launch())
        assert "env.LD_PRELOAD" in cancelled.state_reason
        assert "the runtime host:bash does not allow loader variables" in cancelled.state_reason
        assert "Submit it again" in cancelled.state_reason
        assert not cancelled.attempts


def test_serve_refuses_a_runtimes_table_it_cannot_read_and_never_listens(tmp_path: Path) -> None:
    state_dir = tmp_path / "coordinator"
    admin = [sys.executable, "-m", "tuneplane.coordinator.cli.admin"]
    subprocess.run(
        [*admin, "init", "--state-dir", str(state_dir)], check=True, capture_output=True, timeout=60
    )
    config = state_dir / "coordinator.toml"
    config.write_text(config.read_text() + "\n[runtimes.python3]\nallow_loader_env = true\n")
    done = subprocess.run(
        [*admin, "serve", "--state-dir", str(state_dir), "--api-port", "0", "--control-port", "0",
         "--telemetry-port", "0"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode != 0
    assert (
        f'{config}: [runtimes."python3"] does not name a runtime id. Write the id in quotes as '
        'Jobs name it: [runtimes."host:python3"]'
    ) in done.stderr
    assert not (state_dir / "endpoints.json").exists()
