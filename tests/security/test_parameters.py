"""What every rank runs is the coordinator's to decide at Preview (``command``, ``parameter_env``
in the resolved JobSpec), never the sender's: an intent that sets either is refused over real
gRPC with a sentence naming the field, and nothing is stored (no preview, no Job)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from grpclib.const import Status

from tests.coordinator.grpc_client import jobspec
from tests.security.raw_calls import call
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tuneplane.proto import v1

PREVIEW = "/tuneplane.v1.Api/Preview"


@pytest.fixture(scope="module")
def coord(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    with start_coordinator(tmp_path_factory.mktemp("params")) as c:
        yield c


def _stored(coord: CoordinatorProcess) -> tuple[int, int]:
    """(previews, Jobs) in the coordinator's store."""
    with sqlite3.connect(coord.state_dir / "coordinator.db", timeout=10) as db:
        previews: int = db.execute("SELECT count(*) FROM previews").fetchone()[0]
        jobs: int = db.execute("SELECT count(*) FROM jobs").fetchone()[0]
    return previews, jobs


def _preview(coord: CoordinatorProcess, spec: dict[str, Any], token: str) -> Any:
    body = bytes(v1.PreviewRequest(jobspec_json=json.dumps(spec)))
    return asyncio.run(call(coord.api, coord.ca_path, PREVIEW, body, token))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "command",
            ["bash", "-c", "cat /etc/shadow"],
            "JobSpec field 'command' = ['bash', '-c', 'cat /etc/shadow']: is computed by the "
            "coordinator at Preview, not sent with the intent. Leave it out; `tp submit` never "
            "sets it.",
        ),
        (
            "parameter_env",
            {"TUNEPLANE_PARAM_STEPS": "1"},
            "JobSpec field 'parameter_env' = {'TUNEPLANE_PARAM_STEPS': '1'}: is computed by the "
            "coordinator at Preview, not sent with the intent. Leave it out; `tp submit` never "
            "sets it.",
        ),
        (
            "parameter_env",
            {"LD_PRELOAD": "/tmp/evil.so"},
            "JobSpec field 'parameter_env.LD_PRELOAD' = '/tmp/evil.so': is not a "
            "TUNEPLANE_PARAM_<NAME> variable (upper-case letters, digits, '_'). Let the "
            "coordinator fill parameter_env at Preview.",
        ),
        (
            "parameter_env",
            {"TUNEPLANE_OUT_DIR": "/var/lib/tuneplane"},
            "JobSpec field 'parameter_env.TUNEPLANE_OUT_DIR' = '/var/lib/tuneplane': is not a "
            "TUNEPLANE_PARAM_<NAME> variable (upper-case letters, digits, '_'). Let the "
            "coordinator fill parameter_env at Preview.",
        ),
    ],
)
def test_an_intent_cannot_choose_what_the_ranks_run(
    coord: CoordinatorProcess, field: str, value: object, message: str
) -> None:
    token = coord.create_user(f"mallory-{uuid.uuid4().hex[:8]}")
    spec = jobspec(method_id="pytorch/process-group", gpus=1)
    spec[field] = value
    before = _stored(coord)
    answer = _preview(coord, spec, token)
    assert answer.status == Status.INVALID_ARGUMENT, answer
    assert answer.message == message
    assert _stored(coord) == before


def test_a_missing_script_is_refused_and_nothing_is_stored(coord: CoordinatorProcess) -> None:
    token = coord.create_user("eve")
    spec = jobspec(method_id="pytorch/process-group", gpus=1)
    spec["entrypoint"] = ["python3", "trian.py"]
    spec["parameters"] = {"script": "trian.py"}
    before = _stored(coord)
    answer = _preview(coord, spec, token)
    assert answer.status == Status.INVALID_ARGUMENT, answer
    assert answer.message == (
        "JobSpec field 'parameters.script' = 'trian.py': is not a file of experiment 'hello', so "
        "nothing would run. Did you mean 'train.sh'? Fix the name in config.yaml or --param and "
        "preview again."
    )
    assert _stored(coord) == before
