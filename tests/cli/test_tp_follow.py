"""The real ``tp`` given several coordinator API addresses: it passes one that refuses
connections (a standby, a dead leader), waits for one that starts after it, and says what each
address said when none answers. The refusing address is a bound socket that does not listen."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from tests.cli.tp_process import TP, run_tp
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.store_backend import current
from tuneplane.coordinator.catalogue import Catalogue
from tuneplane.coordinator.cli import api_client
from tuneplane.coordinator.cli.api_client import ApiClient
from tuneplane.coordinator.cli.connection import Endpoint
from tuneplane.coordinator.cli.project import init_project
from tuneplane.coordinator.cli.scaffold import new_experiment

pytestmark = pytest.mark.timeout(240)


@contextmanager
def refusing_address() -> Iterator[str]:
    """An address where a connection is refused at once, as at a standby's API port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"


def free_ports(count: int) -> list[int]:
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    with start_coordinator(tmp_path_factory.mktemp("coord")) as coord:
        yield coord


def _context(coord: CoordinatorProcess, folder: Path, addresses: list[str]) -> Path:
    """A tp-context.json naming ``addresses`` (the refusing one written as the coordinator)."""
    path = folder / "tp-context.json"
    context = {
        "coordinator": addresses[0],
        "api_addresses": addresses,
        "ca": str(coord.ca_path),
        "token_file": str(coord.state_dir / "admin.token"),
    }
    path.write_text(json.dumps(context))
    return path


def test_tp_passes_an_address_that_refuses_for_the_coordinator_behind_it(
    coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    project = init_project(tmp_path / "proj", "follow")
    new_experiment(project, "hello", "custom/custom", Catalogue.bundled())
    with refusing_address() as standby:
        env = {
            "TUNEPLANE_CONTEXT": str(_context(coordinator, tmp_path, [standby, coordinator.api]))
        }
        listed = run_tp("-v", "job", "ls", "--json", cwd=project.root, env=env)
        assert listed.returncode == 0, listed.stderr
        assert json.loads(listed.stdout) == []
        assert f"rpc=ListJobs address={standby} kind=unreachable" in listed.stderr
        assert f"next={coordinator.api}" in listed.stderr
        # The next tp starts with the coordinator that answered, kept beside the context file.
        kept = tmp_path / "tp-context.json.leader"
        assert kept.read_text() == f"{coordinator.api}\n"
        again = run_tp("-v", "job", "ls", "--json", cwd=project.root, env=env)
        assert again.returncode == 0, again.stderr
        assert f"address={standby}" not in again.stderr
        # The preview records the coordinator that answered, and any of the list commits it.
        done = run_tp("submit", "hello", "--profile", "h200:1", "--preview", "--json",
                      cwd=project.root, env=env)  # fmt: skip
        assert done.returncode == 0, done.stderr
        preview_id = json.loads(done.stdout)["preview_id"]
        saved = json.loads((project.data_dir / "submissions" / f"{preview_id}.json").read_text())
        assert saved["coordinator"] == coordinator.api
        committed = run_tp("submit", "--commit", preview_id, "--json", cwd=project.root, env=env)
        assert committed.returncode == 0, committed.stderr
        assert json.loads(committed.stdout)["kind"] == "receipt"
        # RetryJob is not safe to repeat, but a refused connection never reached a coordinator:
        # the call goes on to the next address, which answers with its own refusal.
        retried = run_tp("job", "retry", "run-nope", cwd=project.root, env=env)
        assert retried.returncode == 1
        assert "there is no Job with run id 'run-nope'" in retried.stderr


def test_a_client_starts_where_the_last_one_found_the_coordinator(
    coordinator: CoordinatorProcess,
) -> None:
    async def ask(endpoint: Endpoint) -> tuple[str, str]:
        async with ApiClient(endpoint) as api:
            first = api.address
            await api.list_fleets()
            return first, api.address

    token = coordinator.admin_token
    with refusing_address() as standby:
        endpoint = Endpoint("127.0.0.1", int(standby.rsplit(":", 1)[1]), coordinator.ca_path,
                            token, (coordinator.api,))  # fmt: skip
        api_client._answered.pop(endpoint.addresses, None)
        assert asyncio.run(ask(endpoint)) == (standby, coordinator.api)
        assert asyncio.run(ask(endpoint)) == (coordinator.api, coordinator.api)


def test_tp_waits_for_a_coordinator_that_starts_after_it(tmp_path: Path) -> None:
    state = tmp_path / "coordinator"
    init = [sys.executable, "-m", "tuneplane.coordinator.cli.admin", "init"]
    subprocess.run([*init, "--state-dir", str(state), *current().init_args()],
                   check=True, capture_output=True, timeout=60)  # fmt: skip
    api_port, control_port, telemetry_port = free_ports(3)
    late = f"127.0.0.1:{api_port}"
    coord = CoordinatorProcess(state, ["--heartbeat-interval", "0.5", "--heartbeat-timeout", "3"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNEPLANE_")}
    with refusing_address() as standby:
        args = ("--coordinator", f"{standby},{late}", "--ca", str(state / "tls" / "ca.pem"),
                "--token-file", str(state / "admin.token"), "--ride-out", "150")  # fmt: skip
        tp = subprocess.Popen(
            [*TP, "-v", *args, "job", "ls", "--json"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert tp.stderr is not None
            # tp has asked the late coordinator, and been refused, before it starts.
            for line in tp.stderr:
                if f"address={late} kind=unreachable" in line:
                    break
            else:
                raise AssertionError(f"tp ended without asking {late}: {tp.wait()}")
            with coord:
                coord.start((api_port, control_port, telemetry_port))
                out, err = tp.communicate(timeout=180)
        finally:
            if tp.poll() is None:
                tp.kill()
                tp.wait()
    assert tp.returncode == 0, err
    assert json.loads(out) == []


def test_when_no_coordinator_answers_tp_names_each_address_and_what_it_said(
    coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    with refusing_address() as one, refusing_address() as two:
        token = str(coordinator.state_dir / "admin.token")
        args = ("--coordinator", f"{one},{two}", "--ca", str(coordinator.ca_path),
                "--token-file", token, "--ride-out", "1")  # fmt: skip
        done = run_tp(*args, "fleet", "ls", cwd=tmp_path)
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: No coordinator answered ListFleets in ")
    assert f"{one} could not be reached (Connection refused); " in line
    assert f"{two} could not be reached (Connection refused). " in line
    assert line.endswith(
        "Check that one of them is running and leads, and that --coordinator or the context "
        "file names their API listeners."
    )
