"""Fleets, Nodes and operations through the real ``tp`` and ``tuneplane-coordinator``.

A real coordinator process (with a quota in coordinator.toml) on loopback TLS; the test plays two
Nodes over real Connect streams and runs ``tp`` as a child process, as a person's shell does.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from grpclib import GRPCError
from grpclib.const import Status

from tests.cli.tp_process import TP, run_tp
from tests.coordinator.grpc_client import Api, NodeStream, api_client, enroll, jobspec, node_stream
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tuneplane.proto import v1

EXITED = v1.MemberState(v1.MemberState.EXITED)


@pytest.fixture(scope="module")
def coord(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    root = tmp_path_factory.mktemp("fleet")
    state_dir = root / "coordinator"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tuneplane.coordinator.cli.admin",
            "init",
            "--state-dir",
            str(state_dir),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    config = state_dir / "coordinator.toml"
    config.write_text(config.read_text() + "\n[quota.default]\nh200 = 3\n")
    # Test Nodes send no heartbeats, so the silence limit is long.
    with start_coordinator(root, heartbeat_interval=0.5, heartbeat_timeout=120) as c:
        yield c


def _user_token(coord: CoordinatorProcess, name: str) -> Path:
    made = coord.admin("user", "create", name)
    assert made.returncode == 0, made.stderr
    path = coord.state_dir / f"{name}.token"
    path.write_text(made.stdout.strip() + "\n")
    return path


def _tp(coord: CoordinatorProcess, *args: str, token: Path | None = None) -> Any:
    env = {"TUNEPLANE_CONTEXT": str(coord.context_path)}
    if token is not None:
        env["TUNEPLANE_TOKEN_FILE"] = str(token)
    return run_tp(*args, cwd=coord.state_dir, env=env)


async def _tp_async(coord: CoordinatorProcess, *args: str, token: Path | None = None) -> Any:
    # In a thread, so the Node streams this test plays keep being served meanwhile.
    return await asyncio.to_thread(_tp, coord, *args, token=token)


async def _json(coord: CoordinatorProcess, *args: str) -> Any:
    done = await _tp_async(coord, *args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


async def _start(api: Api, node: NodeStream, run_id: str, seq: int) -> v1.Prepare:
    """Answer the Prepare for ``run_id`` on ``node``, take the Commit, report running."""
    prepare: v1.Prepare = await node.expect("prepare")
    assert prepare.member.run_id == run_id
    await node.send(prepare_reply=v1.PrepareReply(member=prepare.member, ok=True))
    await node.expect("commit")
    await node.report_running(seq, prepare.member)
    await api.wait_for_state(run_id, "running")
    return prepare


async def _wait_node(coord: CoordinatorProcess, node_id: str, scheduling: str) -> dict[str, Any]:
    deadline = time.monotonic() + 15
    while True:
        shown = await _json(coord, "node", "show", node_id)
        if shown["scheduling"] == scheduling or time.monotonic() > deadline:
            assert shown["scheduling"] == scheduling, shown
            return dict(shown)
        await asyncio.sleep(0.2)


async def _wait_reason(api: Api, run_id: str, prefix: str) -> v1.Job:
    deadline = time.monotonic() + 15
    job = await api.job(run_id)
    while not job.state_reason.startswith(prefix) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        job = await api.job(run_id)
    assert job.state == "queued" and job.state_reason.startswith(prefix), job.to_dict()
    return job


def test_cordon_drain_quota_mine_watch_and_decisions(coord: CoordinatorProcess) -> None:
    alice = _user_token(coord, "alice")
    a = asyncio.run(enroll(coord.control, coord.ca_path, coord.create_join_token(), "host-a", 2))
    b = asyncio.run(enroll(coord.control, coord.ca_path, coord.create_join_token(), "host-b", 2))
    alice_token = alice.read_text().strip()

    async def go() -> dict[str, str]:
        async with (
            api_client(coord.api, coord.ca_path, coord.admin_token) as admin,
            api_client(coord.api, coord.ca_path, alice_token) as researcher,
            node_stream(coord.control, coord.ca_path, a.node_credential, a.node_id, "host-a") as na,
            node_stream(coord.control, coord.ca_path, b.node_credential, b.node_id, "host-b") as nb,
        ):
            nodes = await _json(coord, "node", "ls")
            assert {n["id"]: (n["scheduling"], n["connected"]) for n in nodes} == {
                a.node_id: ("schedulable", True),
                b.node_id: ("schedulable", True),
            }
            fleet = await _json(coord, "fleet", "show", "default")
            (h200,) = fleet["capacity"]
            assert (h200["total"], h200["free"], h200["quota"], fleet["nodes"]) == (4, 4, 3, 2)

            # A researcher may read, but not cordon: the server says no.
            refused = await _tp_async(coord, "node", "cordon", a.node_id, token=alice)
            assert refused.returncode == 1
            assert "only an admin user may" in refused.stderr
            assert (await _json(coord, "node", "show", a.node_id))["scheduling"] == "schedulable"

            # Cordoned: a Job goes to the other Node.
            done = await _tp_async(coord, "node", "cordon", a.node_id, "--reason", "bad fan")
            assert done.returncode == 0, done.stderr
            assert f"Node {a.node_id} is cordoned" in done.stdout
            first = await researcher.submit(jobspec(gpus=2, project="mine"), "k-first")
            prepare1 = await _start(admin, nb, first.run_id, 1)
            # Nothing else fits now: the next Job waits and says why.
            second = await admin.submit(jobspec(gpus=1, project="theirs"), "k-second")
            await _wait_reason(admin, second.run_id, "waiting: needs 1 h200 GPU(s)")

            # Uncordoned: placement resumes on it.
            done = await _tp_async(coord, "node", "uncordon", a.node_id)
            assert done.returncode == 0, done.stderr
            prepare2 = await _start(admin, na, second.run_id, 1)
            assert prepare2.gpu_indexes == [0]

            # Quota h200 = 3 and 3 are in use: a free GPU is not enough.
            third = await admin.submit(jobspec(gpus=1, project="theirs"), "k-third")
            await _wait_reason(admin, third.run_id, "waiting: quota h200 3/3 in use")
            shown = await _tp_async(coord, "job", "show", third.run_id)
            assert "waiting: quota h200 3/3 in use" in shown.stdout

            # Draining: shows draining while its member runs, drained once it exits.
            done = await _tp_async(coord, "node", "drain", b.node_id)
            assert done.returncode == 0, done.stderr
            assert "draining" in done.stdout
            held = await _json(coord, "node", "show", b.node_id)
            assert held["scheduling"] == "draining" and held["connected"]
            assert [m["run_id"] for m in held["members"]] == [first.run_id]
            watch = _start_watch(coord, first.run_id)
            line = await asyncio.to_thread(watch.stdout.readline)  # type: ignore[union-attr]
            assert json.loads(line)["state"] == "running"
            await nb.report(2, prepare1.member, EXITED, has_exit=True, exit_code=0)
            await _wait_node(coord, b.node_id, "drained")
            out, err = await asyncio.to_thread(watch.communicate, timeout=30)
            assert watch.returncode == 0, err
            states = [json.loads(line)["state"] for line in out.splitlines() if line.strip()]
            assert states[-1] == "succeeded"

            # The ended member gave its GPUs back to the quota: the third Job goes to Node a.
            await admin.wait_for_state(third.run_id, "preparing")
            assert (await na.expect("prepare")).member.run_id == third.run_id

            # Ctrl-C leaves a watch cleanly and leaves the Job alone.
            watch = _start_watch(coord, third.run_id)
            line = await asyncio.to_thread(watch.stdout.readline)  # type: ignore[union-attr]
            assert json.loads(line)["state"] == "preparing"
            watch.send_signal(signal.SIGINT)
            _, err = await asyncio.to_thread(watch.communicate, timeout=30)
            assert watch.returncode == 130, err
            assert "Stopped watching" in err and "Traceback" not in err
            assert (await admin.job(third.run_id)).state == "preparing"

            # Requests that can never run are refused at preview.
            for spec, words in (
                (jobspec(gpus=4), "quota of Fleet default"),
                (jobspec(gpus=2, members=2), None),
                (jobspec(gpus=3, members=3), "can never fit Fleet default"),
            ):
                if words is None:
                    await admin.preview(spec)
                    continue
                with pytest.raises(GRPCError) as caught:
                    await admin.preview(spec)
                assert caught.value.status is Status.INVALID_ARGUMENT
                assert words in str(caught.value.message)
            return {"first": first.run_id, "second": second.run_id, "a": a.node_id, "b": b.node_id}

    ids = asyncio.run(go())

    mine = json.loads(_tp(coord, "job", "ls", "--mine", "--json", token=alice).stdout)
    assert [j["run_id"] for j in mine] == [ids["first"]]
    assert mine[0]["owner"] == "alice"

    log = coord.admin("decisions", "--json")
    assert log.returncode == 0, log.stderr
    rows = [json.loads(line) for line in log.stdout.splitlines()]
    kinds = [(r["kind"], r["node_id"]) for r in rows if r["kind"].startswith("node ")]
    assert ("node cordoned", ids["a"]) in kinds
    assert ("node uncordoned", ids["a"]) in kinds
    assert kinds.index(("node draining", ids["b"])) < kinds.index(("node drained", ids["b"]))
    cordon = next(r for r in rows if r["kind"] == "node cordoned")
    assert cordon["detail"] == {
        "by": "admin",
        "from": "schedulable",
        "reason": "bad fan",
        "to": "cordoned",
    }
    one_run = coord.admin("decisions", "--run", ids["first"])
    assert one_run.returncode == 0, one_run.stderr
    lines = one_run.stdout.splitlines()
    assert lines and all(ids["first"] in line for line in lines)
    assert any("admission" in line for line in lines) and any("commit" in line for line in lines)
    assert coord.admin("decisions", "--since", "1h").stdout.count("\n") == len(rows)
    assert coord.admin("decisions", "--since", "soon").returncode == 1

    human = _tp(coord, "node", "ls")
    assert human.returncode == 0 and "drained" in human.stdout and "connected" in human.stdout


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_watch(coord: CoordinatorProcess, run_id: str) -> subprocess.Popen[str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNEPLANE_")}
    env["TUNEPLANE_CONTEXT"] = str(coord.context_path)
    return subprocess.Popen(
        [*TP, "job", "show", run_id, "--watch", "--json", "--interval", "0.2"],
        cwd=coord.state_dir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C at a terminal reaches a process whose SIGINT is at its default. A test run
        # started in the background by a non-interactive shell inherits SIGINT ignored, and a
        # Python child then never sees the test's SIGINT.
        preexec_fn=_default_sigint,
    )
