"""A Job's ``runtime_id`` is checked by the Node at Prepare against what it can run: a runtime
whose interpreter is not an executable file on this Node (or a runtime of no kind it knows) is
refused with a sentence naming the
runtime and what the Node offers, before any account, file or process exists for the member and
with its GPUs released; the Node keeps serving. Real coordinator, real agent."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agent.jobs import journal, wait_job
from tests.coordinator.grpc_client import api_client, jobspec
from tests.faults.jobs import held_gpus
from tests.support.agent import start_agent
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tuneplane.agent.config import WorkloadPolicy
from tuneplane.agent.members_prepare import runtime_of
from tuneplane.agent.prepare import PrepareRefused
from tuneplane.proto.contract import jobspec as contract_jobspec

MISSING = "/opt/tuneplane-test-missing/python3"
# host:python3 points at an interpreter this machine does not have; host:bash is real.
NODE_TOML = f'[runtimes.python3]\npath = "/usr/bin:/bin"\ninterpreter = "{MISSING}"\n'
OFFERS = (
    "host:python3 (node.toml) and host:<program> for a program on /usr/local/bin:/usr/bin:/bin, "
    "and images pinned as image:<registry>/<name>@sha256:<digest>"
)


@pytest.fixture(scope="module")
def coord(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    with start_coordinator(tmp_path_factory.mktemp("runtime")) as c:
        yield c


def _submit(coord: CoordinatorProcess, runtime_id: str, key: str) -> str:
    spec: dict[str, Any] = jobspec(gpus=1)
    spec["runtime_id"] = runtime_id

    async def go() -> str:
        async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
            return (await api.submit(spec, key)).run_id

    return asyncio.run(go())


def test_the_node_refuses_at_prepare_a_runtime_it_cannot_run(
    coord: CoordinatorProcess, tmp_path: Path
) -> None:
    agent = start_agent(tmp_path, coord, "node-a", "h200:2", node_toml=NODE_TOML)
    try:
        agent.wait_connected()
        token = agent.state_dir / "credentials" / "control.token"
        token_before = token.read_bytes()
        cases = {
            "host:python3": (
                f"This Node cannot run the runtime 'host:python3': its interpreter '{MISSING}' "
                "(as [runtimes.python3] of node.toml defines it) is not an executable file "
                f"here. This Node runs {OFFERS}. Submit the Job on one of those, or ask this "
                "Node's operator to install the interpreter or define [runtimes.python3] in "
                "node.toml."
            ),
            "host:tuneplane-no-such-program": (
                "This Node cannot run the runtime 'host:tuneplane-no-such-program': its "
                "interpreter 'tuneplane-no-such-program' (looked up on "
                "/usr/local/bin:/usr/bin:/bin, as node.toml has no "
                "[runtimes.tuneplane-no-such-program]) is not an executable file here."
            ),
            "conda:trainer": "is neither a host runtime nor an image; this Node runs " + OFFERS,
        }
        for n, (runtime_id, sentence) in enumerate(cases.items()):
            run_id = _submit(coord, runtime_id, f"runtime-{n}")
            done = wait_job(coord, run_id, 60)
            assert done["state"] == "aborted", done
            assert sentence in done["state_reason"], done
            (member,) = [m for m in journal(agent, "members", "--json") if m["run_id"] == run_id]
            assert member["state"] == "aborted" and sentence in member["reason"], member
            # Nothing of the member was made, and its GPU is free again.
            assert not Path(member["out_dir"]).exists()
            assert not (agent.work_root / member["member"]).exists()
            assert held_gpus(agent) == []

        # The Node is as it was and still runs a Job on a runtime it has.
        assert token.read_bytes() == token_before
        assert agent.wait_connected()["connected"]
        run_id = _submit(coord, "host:bash", "runtime-ok")
        done = wait_job(coord, run_id, 60)
        assert done["state"] == "succeeded", done
        assert held_gpus(agent) == []
    finally:
        agent.stop()


def test_the_node_refuses_an_image_named_by_tag() -> None:
    """A tag never reaches a Node through a coordinator (Preview pins it, or refuses a registry
    its Fleet does not list: tests/coordinator/test_image_pin.py), but a Node that is handed one
    still refuses it rather than pull whatever the tag names today."""
    spec: dict[str, Any] = jobspec(gpus=1)
    spec["runtime_id"] = "image:registry.example/trainer:2.4"
    with pytest.raises(PrepareRefused) as refused:
        runtime_of(contract_jobspec.loads(json.dumps(spec)), WorkloadPolicy("pool"))
    assert (
        "The image reference 'image:registry.example/trainer:2.4' names no digest (resolve the "
        "tag '2.4' at Preview); a Node pulls images only by digest"
    ) in str(refused.value)
