"""The test plays a Node over real gRPC against a real coordinator: prepare, commit, reports."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.coordinator.grpc_client import Api, api_client, enroll, jobspec, node_stream
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.store_backend import StoreBackend
from tuneplane.proto import v1

RUNNING = v1.MemberState(v1.MemberState.RUNNING)
EXITED = v1.MemberState(v1.MemberState.EXITED)
ABORTED = v1.MemberState(v1.MemberState.ABORTED)


@pytest.fixture(scope="module")
def coord(
    tmp_path_factory: pytest.TempPathFactory, module_store_backend: StoreBackend
) -> Iterator[CoordinatorProcess]:
    with start_coordinator(
        tmp_path_factory.mktemp("protocol"),
        heartbeat_interval=0.5,
        heartbeat_timeout=5,
        prepare_timeout=3,
    ) as c:
        yield c


def _node(coord: CoordinatorProcess, hostname: str, gpus: int = 2) -> v1.EnrollReply:
    token = coord.create_join_token()
    return asyncio.run(enroll(coord.control, coord.ca_path, token, hostname, gpus))


async def _launch(api: Api, node: Any, project: str, gpus: int = 2) -> tuple[str, v1.Prepare]:
    """Submit a Job, answer its Prepare with ok, and receive the Commit."""
    receipt = await api.submit(jobspec(gpus=gpus, project=project), f"key-{project}")
    prepare: v1.Prepare = await node.expect("prepare")
    assert prepare.member.run_id == receipt.run_id
    await api.wait_for_state(receipt.run_id, "preparing")
    await node.send(
        prepare_reply=v1.PrepareReply(
            member=prepare.member,
            ok=True,
            rendezvous=v1.Rendezvous(master_addr="127.0.0.1", master_port=29500),
        )
    )
    commit: v1.Commit = await node.expect("commit")
    assert commit.member == prepare.member
    assert (commit.rendezvous.master_addr, commit.rendezvous.master_port) == ("127.0.0.1", 29500)
    await api.wait_for_state(receipt.run_id, "starting")
    return receipt.run_id, prepare


def test_a_job_runs_to_success_and_a_repeated_report_is_applied_once(
    coord: CoordinatorProcess,
) -> None:
    enrolled = _node(coord, "node-ok")

    async def go() -> v1.Job:
        async with (
            api_client(coord.api, coord.ca_path, coord.admin_token) as api,
            node_stream(
                coord.control,
                coord.ca_path,
                enrolled.node_credential,
                enrolled.node_id,
                hostname="node-ok",
            ) as node,
        ):
            run_id, prepare = await _launch(api, node, "succeeds")
            assert prepare.member_count == 1
            assert sorted(prepare.gpu_indexes) == [0, 1]
            # Each index goes with the UUID the Node's inventory gave it (the Node checks them).
            assert prepare.gpu_uuids == [f"GPU-node-ok-{i}" for i in prepare.gpu_indexes]
            assert prepare.pick_rendezvous
            for name, data in prepare.capsule_files.items():
                assert prepare.capsule_digests[name] == "sha256:" + hashlib.sha256(data).hexdigest()
            capsule = json.loads(prepare.capsule_files["capsule.json"])
            assert capsule["run_id"] == run_id
            assert capsule["launcher"] == "member"
            assert capsule["entrypoint"] == ["bash", "train.sh"]
            assert json.loads(prepare.jobspec_json)["source_files"]["train.sh"]

            assert await node.report_running(1, prepare.member) == 3
            await api.wait_for_state(run_id, "running")
            assert await node.report(4, prepare.member, EXITED, has_exit=True, exit_code=0) == 4
            # The same report again (the Node did not see the ack): acked, not applied twice.
            assert await node.report(4, prepare.member, EXITED, has_exit=True, exit_code=0) == 4
            # An old report arriving late is acked and changes nothing.
            assert await node.report(3, prepare.member, RUNNING) == 3
            return await api.wait_for_state(run_id, "succeeded")

    job = asyncio.run(go())
    member = job.attempts[0].members[0]
    assert member.state == "exited" and member.has_exit and member.exit_code == 0
    assert [h.state for h in member.history] == [
        "reserved",
        "preparing",
        "prepared",
        "committed",
        "starting",
        "running",
        "exited",
    ]
    assert [h.state for h in job.history] == [
        "queued",
        "reserved",
        "preparing",
        "starting",
        "running",
        "succeeded",
    ]


def test_a_nonzero_exit_fails_the_job_and_frees_the_gpus(coord: CoordinatorProcess) -> None:
    enrolled = _node(coord, "node-fail")

    async def go() -> tuple[v1.Job, v1.Prepare]:
        async with (
            api_client(coord.api, coord.ca_path, coord.admin_token) as api,
            node_stream(
                coord.control,
                coord.ca_path,
                enrolled.node_credential,
                enrolled.node_id,
                hostname="node-fail",
            ) as node,
        ):
            run_id, prepare = await _launch(api, node, "fails")
            seq = await node.report_running(1, prepare.member)
            await node.report(seq + 1, prepare.member, EXITED, has_exit=True, exit_code=3)
            job = await api.wait_for_state(run_id, "failed")
            # The GPUs came back: the next Job is placed on the same Node's GPUs.
            _, again = await _launch(api, node, "after-failure")
            return job, again

    job, again = asyncio.run(go())
    member = job.attempts[0].members[0]
    assert member.has_exit and member.exit_code == 3
    assert job.history[-1].reason == "member 0 exited with code 3"
    assert sorted(again.gpu_indexes) == [0, 1]


def test_a_refused_prepare_aborts_the_launch(coord: CoordinatorProcess) -> None:
    enrolled = _node(coord, "node-refuse")

    async def go() -> tuple[v1.Job, v1.Abort]:
        async with (
            api_client(coord.api, coord.ca_path, coord.admin_token) as api,
            node_stream(
                coord.control,
                coord.ca_path,
                enrolled.node_credential,
                enrolled.node_id,
                hostname="node-refuse",
            ) as node,
        ):
            receipt = await api.submit(jobspec(project="refused"), "key-refused")
            prepare: v1.Prepare = await node.expect("prepare")
            await node.send(
                prepare_reply=v1.PrepareReply(member=prepare.member, ok=False, reason="GPU 1 busy")
            )
            abort = await node.expect("abort")
            return await api.wait_for_state(receipt.run_id, "aborted"), abort

    job, abort = asyncio.run(go())
    assert "GPU 1 busy" in abort.reason
    assert "GPU 1 busy" in job.history[-1].reason
    assert job.attempts[0].state == "aborted"


def test_a_refused_members_report_before_its_reply_stops_no_sibling_before_the_abort(
    coord: CoordinatorProcess,
) -> None:
    """A Node that refuses Prepare journals the member aborted and reports it besides replying;
    the report may be handled first. The launch is still decided by the reply: the sibling on
    the other Node gets the Abort recorded with the decision, never a Cancel sent before it
    (which a coordinator crash between the two would have left undecided)."""
    # Members are indexed by Node id: ``x`` holds member 0.
    x, y = sorted((_node(coord, "node-sib-x"), _node(coord, "node-sib-y")), key=lambda e: e.node_id)

    async def go() -> tuple[str, Any, v1.Job]:
        async with (
            api_client(coord.api, coord.ca_path, coord.admin_token) as api,
            node_stream(coord.control, coord.ca_path, x.node_credential, x.node_id,
                        hostname=x.node_id) as on_x,
            node_stream(coord.control, coord.ca_path, y.node_credential, y.node_id,
                        hostname=y.node_id) as on_y,
        ):  # fmt: skip
            receipt = await api.submit(jobspec(gpus=4, project="sibling"), "key-sibling")
            # Member 0 first: it holds the rendezvous the others are prepared with.
            prepared: v1.Prepare = await on_x.expect("prepare")
            await on_x.send(
                prepare_reply=v1.PrepareReply(
                    member=prepared.member,
                    ok=True,
                    rendezvous=v1.Rendezvous(master_addr="127.0.0.1", master_port=29500),
                    rendezvous_held=True,
                )
            )
            refused: v1.Prepare = await on_y.expect("prepare")
            why = "the work root is not a directory"
            await on_y.report(1, refused.member, ABORTED, reason=why)
            await on_y.send(
                prepare_reply=v1.PrepareReply(member=refused.member, ok=False, reason=why)
            )
            kind, body = await on_x.recv()
            return kind, body, await api.wait_for_state(receipt.run_id, "aborted")

    kind, body, job = asyncio.run(go())
    assert kind == "abort", (kind, body)
    assert "the work root is not a directory" in job.history[-1].reason


def test_a_prepare_timeout_aborts_and_the_node_can_ask_for_the_decision(
    coord: CoordinatorProcess,
) -> None:
    enrolled = _node(coord, "node-slow")

    async def go() -> tuple[v1.Job, v1.Abort, v1.Abort]:
        async with (
            api_client(coord.api, coord.ca_path, coord.admin_token) as api,
            node_stream(
                coord.control,
                coord.ca_path,
                enrolled.node_credential,
                enrolled.node_id,
                hostname="node-slow",
            ) as node,
        ):
            receipt = await api.submit(jobspec(project="slow"), "key-slow")
            prepare: v1.Prepare = await node.expect("prepare")
            # Never reply; keep the stream alive with heartbeats until the Abort comes.
            for seq in range(1, 40):
                await node.send(heartbeat=v1.Heartbeat(seq=seq))
                kind, body = await node.recv(timeout=10)
                if kind == "abort":
                    break
                await asyncio.sleep(0.2)
            else:
                raise AssertionError("no Abort after the prepare timeout")
            await node.send(decision_query=v1.DecisionQuery(member=prepare.member))
            asked = await node.expect("abort")
            return await api.wait_for_state(receipt.run_id, "aborted"), body, asked

    job, abort, asked = asyncio.run(go())
    assert "prepare deadline" in abort.reason
    assert asked.reason == abort.reason
    assert job.attempts[0].members[0].state == "aborted"


def test_a_dropped_node_makes_the_job_unknown_until_it_reports_again(
    coord: CoordinatorProcess,
) -> None:
    enrolled = _node(coord, "node-drop")

    async def go() -> tuple[v1.Job, v1.Job, v1.Job]:
        async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
            async with node_stream(
                coord.control,
                coord.ca_path,
                enrolled.node_credential,
                enrolled.node_id,
                hostname="node-drop",
            ) as node:
                run_id, prepare = await _launch(api, node, "drops")
                await node.report_running(1, prepare.member)
                await api.wait_for_state(run_id, "running")
            # The stream closed: the workload may well still run. Never failed, only unknown.
            unknown = await api.wait_for_state(run_id, "unknown")
            held = [v1.HeldMember(member=prepare.member, state=RUNNING)]
            async with node_stream(
                coord.control,
                coord.ca_path,
                enrolled.node_credential,
                enrolled.node_id,
                hostname="node-drop",
                held=held,
            ) as node:
                back = await api.wait_for_state(run_id, "running")
                await node.report(4, prepare.member, EXITED, has_exit=True, exit_code=0)
                done = await api.wait_for_state(run_id, "succeeded")
            return unknown, back, done

    unknown, back, done = asyncio.run(go())
    assert unknown.attempts[0].members[0].state == "unknown"
    assert back.attempts[0].members[0].state == "running"
    assert done.attempts[0].members[0].exit_code == 0


def test_a_resent_prepare_names_the_cards_placed_not_the_inventory_now(
    coord: CoordinatorProcess,
) -> None:
    """A Node that reconnects before answering gets its Prepare again, with the UUIDs recorded
    at placement even though its new Hello lists other cards: the Node, not the coordinator,
    decides whether they are still the same cards."""
    enrolled = _node(coord, "node-re")

    async def go() -> tuple[v1.Prepare, v1.Prepare]:
        async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
            async with node_stream(
                coord.control, coord.ca_path, enrolled.node_credential, enrolled.node_id,
                hostname="node-re",
            ) as node:  # fmt: skip
                await api.submit(jobspec(gpus=2, project="resent"), "key-resent")
                first: v1.Prepare = await node.expect("prepare")
            async with node_stream(
                coord.control, coord.ca_path, enrolled.node_credential, enrolled.node_id,
                hostname="node-re-rebuilt",
            ) as node:  # fmt: skip
                again: v1.Prepare = await node.expect("prepare")
            return first, again

    first, again = asyncio.run(go())
    assert again.member == first.member and again.gpu_indexes == first.gpu_indexes
    assert first.gpu_uuids == [f"GPU-node-re-{i}" for i in first.gpu_indexes]
    assert again.gpu_uuids == first.gpu_uuids
