"""WatchJob against a real coordinator over loopback TLS, with the test playing the Node.

The coordinator's fallback interval is an hour (``[limits] job_watch_fallback_s``), far past
every wait here: each change a watch shows before the test's timeout came from the store's
post-commit notice, never from the fallback read.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import pytest
from grpclib import GRPCError
from grpclib.const import Status

from tests.coordinator.grpc_client import (
    Api,
    api_client,
    enrolled_node,
    job_ids,
    jobspec,
    node_stream,
)
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.store_backend import StoreBackend
from tuneplane.coordinator.cli.api_client import ApiClient
from tuneplane.coordinator.cli.connection import Endpoint
from tuneplane.proto import v1

EXITED = v1.MemberState(v1.MemberState.EXITED)
#: The fallback interval the coordinator runs with: no wait in these tests comes near it.
FALLBACK_S = 3600
#: WatchJob streams the coordinator serves at once.
WATCHES = 3
#: The longest any one wait here may take (a hang, not a slow machine, reaches it).
WAIT_S = 60.0
#: A Job of this many GPUs stays queued: only a Node that never connects could hold it.
QUEUED_GPUS = 4


@pytest.fixture(scope="module")
def coord(
    tmp_path_factory: pytest.TempPathFactory, module_store_backend: StoreBackend
) -> Iterator[CoordinatorProcess]:
    limits = f"\n[limits]\njob_watch_fallback_s = {FALLBACK_S}\njob_watches = {WATCHES}\n"
    with start_coordinator(
        tmp_path_factory.mktemp("watch"), heartbeat_timeout=5, prepare_timeout=30, config=limits
    ) as c:
        # Enrolled, never connected: Preview accepts a Job of QUEUED_GPUS, and none runs it.
        enrolled_node(c, "parked", gpus=QUEUED_GPUS)
        yield c


def _watch(api: Api, run_id: str) -> AsyncIterator[v1.Job]:
    return api.stub.watch_job(v1.GetJobRequest(run_id=run_id), timeout=WAIT_S * 2)


async def _until(stream: AsyncIterator[v1.Job], state: str, seen: list[str]) -> v1.Job:
    """Read the watch until it shows ``state``; every state shown is appended to ``seen``."""
    with anyio.fail_after(WAIT_S):
        async for job in stream:
            seen.append(job.state)
            if job.state == state:
                return job
    raise AssertionError(f"the watch ended before it showed {state}; it showed {seen}")


async def _ended(stream: AsyncIterator[v1.Job]) -> list[v1.Job]:
    """What the watch sent until it ended (the stream closed by the coordinator)."""
    with anyio.fail_after(WAIT_S):
        return [job async for job in stream]


async def _queued_job(api: Api) -> str:
    spec = jobspec(gpus=QUEUED_GPUS, project="watch-" + uuid.uuid4().hex[:8])
    receipt = await api.submit(spec, "key-" + uuid.uuid4().hex)
    return receipt.run_id


async def _cancel(api: Api, run_id: str) -> None:
    await api.stub.cancel_job(v1.CancelJobRequest(run_id=run_id, reason="test over"))


def test_a_watch_shows_the_states_in_order_and_ends_after_success(
    coord: CoordinatorProcess,
) -> None:
    enrolled = enrolled_node(coord, "node-watch")

    async def go() -> tuple[list[str], list[v1.Job]]:
        seen: list[str] = []
        async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
            receipt = await api.submit(jobspec(gpus=2, project="watched"), "key-watched")
            stream = _watch(api, receipt.run_id)
            # No Node that could run it is connected yet: the Job is queued.
            await _until(stream, "queued", seen)
            async with node_stream(
                coord.control, coord.ca_path, enrolled.node_credential, enrolled.node_id,
                hostname="node-watch",
            ) as node:  # fmt: skip
                return seen, await _run(node, stream, seen)

    async def _run(node: Any, stream: AsyncIterator[v1.Job], seen: list[str]) -> list[v1.Job]:
        prepare: v1.Prepare = await node.expect("prepare")
        await _until(stream, "preparing", seen)
        await node.send(
            prepare_reply=v1.PrepareReply(
                member=prepare.member,
                ok=True,
                rendezvous=v1.Rendezvous(master_addr="127.0.0.1", master_port=29500),
            )
        )
        await node.expect("commit")
        await _until(stream, "starting", seen)
        seq = await node.report_running(1, prepare.member)
        await _until(stream, "running", seen)
        await node.report(seq + 1, prepare.member, EXITED, has_exit=True, exit_code=0)
        await _until(stream, "succeeded", seen)
        return await _ended(stream)

    seen, after = asyncio.run(go())
    order = ["queued", "reserved", "preparing", "starting", "running", "succeeded"]
    # The states in the Job's order (a change that came and went between two reads may be
    # missed: a watch shows what GetJob shows when it reads; a state shows again when another
    # part of the Job, a member's state, changed).
    assert seen[0] == "queued" and seen[-1] == "succeeded", seen
    states = [s for i, s in enumerate(seen) if i == 0 or seen[i - 1] != s]
    assert [order.index(s) for s in states] == sorted(order.index(s) for s in states), seen
    assert {"preparing", "starting", "running"} <= set(seen), seen
    # After the terminal Job, the stream ended: nothing more was sent.
    assert after == []


def test_a_change_comes_on_its_notice_not_the_fallback(coord: CoordinatorProcess) -> None:
    async def go() -> tuple[v1.Job, v1.Job, list[v1.Job]]:
        async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
            run_id = await _queued_job(api)
            stream = _watch(api, run_id)
            with anyio.fail_after(WAIT_S):
                first = await anext(stream)
            # The fallback is an hour away: only the notice after CancelJob's commit can bring
            # the change within WAIT_S.
            await _cancel(api, run_id)
            cancelled = await _until(stream, "cancelled", [])
            return first, cancelled, await _ended(stream)

    first, cancelled, after = asyncio.run(go())
    assert first.state == "queued"
    assert cancelled.state == "cancelled" and "test over" in cancelled.state_reason
    assert after == []


def test_a_watch_ended_by_its_client_leaves_no_waiter(coord: CoordinatorProcess) -> None:
    async def go() -> tuple[str, GRPCError, v1.Job]:
        async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
            run_id = await _queued_job(api)
            offset = len(coord.read_log())
            streams = [_watch(api, run_id) for _ in range(WATCHES)]
            with anyio.fail_after(WAIT_S):
                for stream in streams:
                    assert (await anext(stream)).run_id == run_id
                # The coordinator's most at once: one more is refused.
                with pytest.raises(GRPCError) as refused:
                    await anext(_watch(api, run_id))
                # The client goes away: each stream is reset, its handler cancelled.
                for stream in streams:
                    await stream.aclose()  # type: ignore[attr-defined]
            await anyio.to_thread.run_sync(
                coord.wait_log, f"job watch closed run_id={run_id} watches=0", WAIT_S, offset
            )
            # Every place is free again: as many watches as before are served.
            again = [_watch(api, run_id) for _ in range(WATCHES)]
            with anyio.fail_after(WAIT_S):
                shown = [await anext(stream) for stream in again]
                for stream in again:
                    await stream.aclose()  # type: ignore[attr-defined]
            await _cancel(api, run_id)
            return run_id, refused.value, shown[-1]

    run_id, refused, shown = asyncio.run(go())
    assert refused.status is Status.RESOURCE_EXHAUSTED
    assert refused.message is not None
    assert f"already serves {WATCHES} WatchJob streams" in refused.message
    assert "job_watches" in refused.message
    assert shown.run_id == run_id and shown.state == "queued"


async def _refusal(call: Any) -> GRPCError:
    with anyio.fail_after(WAIT_S), pytest.raises(GRPCError) as refused:
        await call
    return refused.value


def _history(job: v1.Job) -> list[tuple[str, str]]:
    return [(job.owner, job.state), *((h.state, h.reason) for h in job.history)]


def test_another_users_job_is_refused_as_get_job_refuses_it(coord: CoordinatorProcess) -> None:
    alice, bob = coord.create_user("alice-watch"), coord.create_user("bob-watch")

    async def go() -> tuple[GRPCError, GRPCError, v1.Job, v1.Job, list[str], list[str], str]:
        async with (
            api_client(coord.api, coord.ca_path, alice) as as_alice,
            api_client(coord.api, coord.ca_path, bob) as as_bob,
        ):
            run_id = await _queued_job(as_alice)
            before, ids = await as_alice.job(run_id), await job_ids(coord)
            offset = len(coord.read_log())
            got = await _refusal(as_bob.job(run_id))
            watched = await _refusal(anext(_watch(as_bob, run_id)))
            after, ids_after = await as_alice.job(run_id), await job_ids(coord)
            log = coord.read_log()[offset:]
            await _cancel(as_alice, run_id)
            return got, watched, before, after, ids, ids_after, log

    got, watched, before, after, ids, ids_after, log = asyncio.run(go())
    assert watched.status is got.status
    assert got.status in (Status.PERMISSION_DENIED, Status.NOT_FOUND)
    assert watched.message == got.message and got.message
    # Nothing changed: the Job has the same state, history and attempts (the scheduler may
    # reword why it waits meanwhile), no Job appeared, and no watch was ever opened.
    assert _history(after) == _history(before) and after.attempts == before.attempts
    assert ids_after == ids
    assert "job watch closed" not in log


def test_an_unauthenticated_or_empty_request_is_refused_as_get_job_refuses_it(
    coord: CoordinatorProcess,
) -> None:
    async def go() -> list[tuple[GRPCError, GRPCError]]:
        pairs = []
        async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
            pairs.append((await _refusal(api.job("")), await _refusal(anext(_watch(api, "")))))
        async with api_client(coord.api, coord.ca_path, "not-a-token") as stranger:
            pairs.append(
                (
                    await _refusal(stranger.job("run-x")),
                    await _refusal(anext(_watch(stranger, "run-x"))),
                )
            )
        return pairs

    (empty_get, empty_watch), (anon_get, anon_watch) = asyncio.run(go())
    assert empty_watch.status is empty_get.status is Status.INVALID_ARGUMENT
    assert (
        empty_watch.message
        == empty_get.message
        == ("GetJobRequest.run_id is empty. Name a run id.")
    )
    assert anon_watch.status is anon_get.status is Status.UNAUTHENTICATED
    assert anon_watch.message == anon_get.message


def test_the_client_follows_a_job_to_its_end_on_the_stream(coord: CoordinatorProcess) -> None:
    """``ApiClient.watch_job`` (what ``tp job show --watch`` and the bench read): each Job once,
    then the end."""
    host, _, port = coord.api.rpartition(":")
    endpoint = Endpoint(host, int(port), coord.ca_path, coord.admin_token)

    async def go() -> list[str]:
        async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
            run_id = await _queued_job(api)
        states: list[str] = []
        async with ApiClient(endpoint) as client:
            with anyio.fail_after(WAIT_S):
                async for job in client.watch_job(run_id):
                    states.append(job.state)
                    if job.state == "queued" and states.count("queued") == 1:
                        await client.cancel_job(run_id, "test over")
        return states

    states = asyncio.run(go())
    assert states[0] == "queued" and states[-1] == "cancelled", states


def test_the_client_opens_the_stream_again_when_its_deadline_passed(
    coord: CoordinatorProcess,
) -> None:
    """Each stream lasts at most the client's call timeout; the next one goes on from there,
    and the change after it still arrives (the fallback is an hour away)."""
    host, _, port = coord.api.rpartition(":")
    endpoint = Endpoint(host, int(port), coord.ca_path, coord.admin_token)

    async def go() -> list[str]:
        states: list[str] = []
        async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
            run_id = await _queued_job(api)
            offset = len(coord.read_log())
            async with (
                ApiClient(endpoint, timeout_s=2.0) as client,
                anyio.create_task_group() as tg,
            ):

                async def follow() -> None:
                    async for job in client.watch_job(run_id):
                        states.append(job.state)

                with anyio.fail_after(WAIT_S):
                    tg.start_soon(follow)
                    # The first stream reached its deadline and the coordinator let it go ...
                    await anyio.to_thread.run_sync(
                        coord.wait_log, f"job watch closed run_id={run_id} watches=0", WAIT_S,
                        offset,
                    )  # fmt: skip
                    # ... and the client opened another, which sees the cancel.
                    await _cancel(api, run_id)
        return states

    states = asyncio.run(go())
    assert states[0] == "queued" and states[-1] == "cancelled", states
