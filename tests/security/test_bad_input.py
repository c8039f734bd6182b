"""Bad input is an error, never a crash (issue 8, must have 8 and 11), with real processes.

A real coordinator answers hostile JobSpecs and hostile protobuf with INVALID_ARGUMENT naming the
field, stores nothing and keeps serving; a Prepare the coordinator should never have sent (a NUL
in a file name) is refused by a real agent with a PrepareReply, the Job ends aborted and the
agent keeps running; the real ``tp`` never uploads through a symbolic link.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from grpclib import GRPCError
from grpclib.const import Status
from grpclib.exceptions import StreamTerminatedError

from tests.coordinator.grpc_client import (
    api_client,
    enroll,
    fleet_names,
    job_ids,
    jobspec,
    node_stream,
)
from tests.security.raw_calls import call, frame
from tests.support.agent import AgentProcess, start_agent
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tuneplane.coordinator.gateways.status import grpc_errors
from tuneplane.proto import v1

PREVIEW = "/tuneplane.v1.Api/Preview"
GET_JOB = "/tuneplane.v1.Api/GetJob"
ENROLL = "/tuneplane.v1.Control/Enroll"
TP = [sys.executable, "-m", "tuneplane.coordinator.cli.tp"]


@pytest.fixture(scope="module")
def coord(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    with start_coordinator(tmp_path_factory.mktemp("bad-input")) as c:
        yield c


def _spec_text(**changes: Any) -> str:
    """A valid custom/custom JobSpec as JSON text, with ``changes`` merged in."""
    spec = jobspec(gpus=0, profile="cpu")
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return json.dumps(spec)


DEEP = "[" * 100_000 + "]" * 100_000
HOSTILE_SPECS = [
    ("NUL in a file name", _spec_text(source_files={"a\x00b.sh": "AA=="}), "source_files"),
    ("lone surrogate", _spec_text(parameters={"note": "\ud800"}), "parameters.note"),
    ("deep JSON", _spec_text(parameters={"x": "DEEP"}).replace('"DEEP"', DEEP), "nests deeper"),
    (
        "4,300-digit integer",
        _spec_text(parameters={"big": "HUGE"}).replace('"HUGE"', "9" * 4300),
        "parameters.big",
    ),
    (
        "integer beyond int64",
        _spec_text(grace_period_s="HUGE").replace('"HUGE"', str(2**64)),
        "grace_period_s",
    ),
    ("NaN", _spec_text(parameters={"x": "NAN"}).replace('"NAN"', "NaN"), "NaN"),
    ("loader variable", _spec_text(env={"LD_PRELOAD": "/tmp/x.so"}), "env.LD_PRELOAD"),
    ("PYTHONPATH", _spec_text(env={"PYTHONPATH": "/tmp"}), "env.PYTHONPATH"),
    ("'=' in an env name", _spec_text(env={"A=B": "1"}), "not a valid environment variable"),
    ("NUL in an env value", _spec_text(env={"SEED": "1\x002"}), "env.SEED"),
    ("escaping file name", _spec_text(source_files={"../x.sh": "AA=="}), "relative path"),
    ("absolute file name", _spec_text(source_files={"/etc/x": "AA=="}), "relative path"),
]


@pytest.mark.parametrize(
    ("what", "text", "named"), HOSTILE_SPECS, ids=[h[0] for h in HOSTILE_SPECS]
)
def test_a_hostile_jobspec_is_invalid_argument_naming_the_field(
    coord: CoordinatorProcess, what: str, text: str, named: str
) -> None:
    body = bytes(v1.PreviewRequest(jobspec_json=text))
    answer = asyncio.run(call(coord.api, coord.ca_path, PREVIEW, body, coord.admin_token))
    assert answer.status == Status.INVALID_ARGUMENT, (what, answer)
    assert named in answer.message, (what, answer.message)
    assert answer.message.rstrip().endswith("."), answer.message
    # Nothing was admitted and the coordinator still serves.
    assert asyncio.run(job_ids(coord)) == []
    assert asyncio.run(fleet_names(coord)) == ["default"]


def test_hostile_protobuf_is_invalid_argument_and_the_coordinator_keeps_serving(
    coord: CoordinatorProcess,
) -> None:
    cases = [
        (bytes(v1.GetJobRequest(run_id="run-\x00")), "GetJobRequest.run_id contains a NUL"),
        (frame(1, b"run-\xed\xa0\x80"), "cannot be decoded"),  # a surrogate, UTF-8 encoded
        (frame(1, b"\xff\xfe"), "cannot be decoded"),
        (b"\xff" * 12, "GetJobRequest"),
        (frame(1, b"x")[:-1] + b"", "GetJobRequest"),
    ]
    for body, named in cases:
        answer = asyncio.run(call(coord.api, coord.ca_path, GET_JOB, body, coord.admin_token))
        assert answer.status == Status.INVALID_ARGUMENT, (body, answer)
        assert named in answer.message, (body, answer.message)
    assert asyncio.run(fleet_names(coord)) == ["default"]
    assert "error_id" not in coord.read_log()


def test_a_nul_in_enroll_is_refused_and_spends_nothing(coord: CoordinatorProcess) -> None:
    token = coord.create_join_token()
    body = bytes(v1.EnrollRequest(join_token=token, hostname="evil\x00host"))
    answer = asyncio.run(call(coord.control, coord.ca_path, ENROLL, body))
    assert answer.status == Status.INVALID_ARGUMENT, answer
    assert "EnrollRequest.hostname contains a NUL" in answer.message
    # The join token is unspent: a clean Enroll with it works.
    node = asyncio.run(enroll(coord.control, coord.ca_path, token, "clean-host", 1))
    assert node.node_id


def test_an_unexpected_error_is_internal_with_an_id_that_is_in_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR)
    with pytest.raises(GRPCError) as caught, grpc_errors():
        raise KeyError("a bug")
    assert caught.value.status == Status.INTERNAL
    message = caught.value.message or ""
    error_id = message.split("error id ")[1].split(")")[0]
    assert len(error_id) == 12
    assert f"error_id={error_id}" in caplog.text and "KeyError" in caplog.text


@contextmanager
def _hostile_control(
    tmp_path: Path, mode: str, timeout: float
) -> Iterator[tuple[dict[str, Any], AgentProcess]]:
    """A real agent enrolled with a real coordinator, whose control address is then served by
    ``hostile_control.py <mode>`` until it is done. Yields what the stand-in saw and the agent,
    checked to be alive with no traceback in its log."""
    coord = start_coordinator(tmp_path)
    agent = start_agent(tmp_path, coord, "node-a", simulate_gpus="h200:1")
    try:
        agent.wait_connected()
        host, _, port = coord.control.rpartition(":")
        coord.stop()
        out = tmp_path / "hostile.json"
        done = subprocess.run(
            [sys.executable, "-m", "tests.security.hostile_control", mode, host, port,
             str(coord.state_dir), str(out)],
            cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
            timeout=timeout, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert agent.alive(), agent.read_log()
        assert "Traceback" not in agent.read_log()
        yield json.loads(out.read_text()), agent
    finally:
        agent.stop()
        coord.kill()


def test_an_agent_refuses_a_prepare_with_a_nul_in_a_file_name_and_keeps_running(
    tmp_path: Path,
) -> None:
    """A real agent, enrolled with a real coordinator, then served by a stand-in on the same
    address (``hostile_control.py``) that sends what the real one never would: NUL in an
    experiment file name, in a capsule file name, and in the run id itself."""
    with _hostile_control(tmp_path, "prepare", timeout=120) as (seen, agent):
        by_run = {r["run_id"]: r for r in seen["replies"]}
        for run_id, named in (
            ("run-nul-source", "source_files"),
            ("run-nul-capsule", "capsule file name"),
        ):
            assert not by_run[run_id]["ok"], by_run
            assert "NUL" in by_run[run_id]["reason"], by_run
            assert named in by_run[run_id]["reason"], by_run
        # The third order was skipped, and the session went on: heartbeats kept coming.
        assert "run-\x00" not in by_run
        assert seen["heartbeats_after"] >= 3 and seen["connections"] == 1, seen
        assert "MemberRef.run_id contains a NUL" in agent.read_log()
        # Nothing was written for the refused members (every name is checked before writing).
        written = [p.name for p in agent.state_dir.rglob("*.sh")]
        assert written == [], written


def test_an_agent_survives_undecodable_and_oversized_messages_from_its_coordinator(
    tmp_path: Path,
) -> None:
    """The stand-in sends bytes that are no message, then a 40 MiB message; each ends that
    session with a sentence, the agent reconnects, and stays connected to a sane coordinator."""
    with _hostile_control(tmp_path, "flood", timeout=150) as (seen, agent):
        assert seen["connections"] == 3 and seen["heartbeats_after"] >= 3, seen
        log = agent.read_log()
        # The codec's own error type is named (RuntimeError from betterproto's Rust codec).
        assert "CoordinatorMessage message cannot be decoded (" in log
        assert "over the limit of 33554432 bytes" in log


def _tp(root: Path, *args: str, context: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TP, "--context", str(context), *args],
        cwd=root, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_tp_never_uploads_through_a_symbolic_link(
    coord: CoordinatorProcess, tmp_path: Path
) -> None:
    root = tmp_path / "proj"
    root.mkdir()
    for args in (
        ("init", str(root), "--name", "links"),
        ("new", "job", "--method", "custom/custom"),
    ):
        done = _tp(root, *args, context=coord.context_path)
        assert done.returncode == 0, done.stderr
    experiment = root / "experiments" / "job"
    secret = tmp_path / "control.token"
    secret.write_text("tpn-secret\n")
    outside = experiment / "token.txt"
    outside.symlink_to(secret)
    submit = ("submit", "job", "--profile", "cpu:0", "--preview", "--json")
    done = _tp(root, *submit, context=coord.context_path)
    assert done.returncode != 0
    assert f"{outside} is a symbolic link that leads outside the experiment" in done.stderr
    assert str(secret) in done.stderr
    assert "tpn-secret" not in done.stdout + done.stderr
    outside.unlink()
    inside = experiment / "again.sh"
    inside.symlink_to(experiment / "train.sh")
    done = _tp(root, *submit, context=coord.context_path)
    assert done.returncode != 0
    assert f"{inside} is a symbolic link (to {experiment / 'train.sh'})" in done.stderr
    inside.unlink()
    done = _tp(root, *submit, context=coord.context_path)
    assert done.returncode == 0, done.stderr
    assert asyncio.run(job_ids(coord)) == []


def test_tp_shows_a_hostile_hostname_as_text_not_as_terminal_codes(
    coord: CoordinatorProcess,
) -> None:
    """A Node names itself with an escape sequence (clear screen, set window title); whoever
    lists Nodes sees it spelled out, and their terminal receives no control character."""
    hostname = "evil\x1b[2J\x1b]0;pwned\x07host"
    node = asyncio.run(enroll(coord.control, coord.ca_path, coord.create_join_token(), hostname, 1))
    done = subprocess.run(
        [*TP, "--context", str(coord.context_path), "node", "ls"],
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "COLUMNS": "250"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert node.node_id in done.stdout
    assert "evil\\x1b[2J\\x1b]0;pwned\\x07host" in done.stdout
    assert not any(ch in done.stdout for ch in "\x1b\x07\x00")


def test_a_stored_jobspec_that_no_longer_passes_ends_its_job_not_the_coordinator(
    tmp_path: Path,
) -> None:
    """A Job admitted under looser rules (an older coordinator, or a store edited by hand) is
    read again by the scheduler at launch: it is cancelled with the sentence, and the
    coordinator goes on serving."""
    with start_coordinator(tmp_path) as coord:
        node = asyncio.run(enroll(coord.control, coord.ca_path, coord.create_join_token(), "n", 2))

        def tamper(preview_id: str, resolved_json: str) -> None:
            hostile = json.loads(resolved_json)
            hostile["env"] = {"LD_PRELOAD": "/tmp/x.so"}
            with sqlite3.connect(coord.state_dir / "coordinator.db", timeout=10) as db:
                db.execute(
                    "UPDATE previews SET resolved_json = ? WHERE id = ?",
                    (json.dumps(hostile), preview_id),
                )

        async def scenario() -> tuple[v1.Job, list[str]]:
            async with (
                node_stream(coord.control, coord.ca_path, node.node_credential, node.node_id),
                api_client(coord.api, coord.ca_path, coord.admin_token) as api,
            ):
                reply = await api.preview(jobspec(gpus=1, profile="h200"))
                await anyio.to_thread.run_sync(
                    tamper, reply.preview_id, reply.resolved_jobspec_json
                )
                receipt = await api.commit(reply, "stored-jobspec")
                job = await api.wait_for_state(receipt.run_id, "cancelled", timeout=30)
                return job, await fleet_names(coord)

        job, fleets = asyncio.run(scenario())
        assert "env.LD_PRELOAD" in job.state_reason and "Submit it again" in job.state_reason
        assert not job.attempts, job.attempts  # nothing was reserved or sent to the Node
        assert fleets == ["default"]
        assert "queued job refused" in coord.read_log()


def _previews(coord: CoordinatorProcess) -> int:
    with sqlite3.connect(coord.state_dir / "coordinator.db", timeout=10) as db:
        count: int = db.execute("SELECT count(*) FROM previews").fetchone()[0]
    return count


def test_tp_sends_a_loader_variable_and_shows_the_coordinators_refusal(
    coord: CoordinatorProcess, tmp_path: Path
) -> None:
    """Whether a loader variable may be set is the site's policy, which ``tp`` cannot know: it
    checks the form only and the coordinator (coordinator.toml, here the default) refuses."""
    root = tmp_path / "proj"
    root.mkdir()
    for args in (("init", str(root), "--name", "env"), ("new", "job", "--method", "custom/custom")):
        assert _tp(root, *args, context=coord.context_path).returncode == 0
    previews = _previews(coord)
    for flag in ("LD_PRELOAD=/tmp/x.so", "PYTHONPATH=/tmp", "LD_LIBRARY_PATH=/tmp"):
        done = _tp(
            root, "submit", "job", "--profile", "cpu:0", "--env", flag, "--preview",
            context=coord.context_path,
        )  # fmt: skip
        name = flag.split("=")[0]
        assert done.returncode != 0
        assert f"JobSpec field 'env.{name}'" in done.stderr, done.stderr
        assert "the runtime host:bash does not allow loader variables" in done.stderr
        assert '[runtimes."host:bash"] allow_loader_env = true in coordinator.toml' in done.stderr
    # The form is still tp's to check, before anything is sent.
    done = _tp(
        root, "submit", "job", "--profile", "cpu:0", "--env", "LD-PRELOAD=/x", "--preview",
        context=coord.context_path,
    )  # fmt: skip
    assert done.returncode != 0, done.stderr
    assert "--env LD-PRELOAD: is not a valid environment variable name" in done.stderr
    assert asyncio.run(job_ids(coord)) == []
    assert _previews(coord) == previews


def test_a_task_group_failing_with_a_status_or_a_dropped_peer_is_not_internal() -> None:
    refusal = GRPCError(Status.PERMISSION_DENIED, "not yours.")
    with pytest.raises(GRPCError) as caught, grpc_errors():
        raise ExceptionGroup("session", [refusal])
    assert caught.value is refusal
    with pytest.raises(StreamTerminatedError), grpc_errors():
        raise ExceptionGroup("session", [StreamTerminatedError("Connection lost")])
    with pytest.raises(GRPCError) as caught, grpc_errors():
        raise ExceptionGroup("session", [StreamTerminatedError("x"), ValueError("a bug")])
    assert caught.value.status == Status.INTERNAL
