"""Many Nodes reconnecting at once after a coordinator was killed: every one is welcomed, and each
gets exactly the orders it is owed (a Commit decided while it held a prepared member, the Prepare
of an undecided attempt, the Cancel of a stopped Job), whatever Hellos its own shared a
transaction with. Real coordinator processes over loopback TLS, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import anyio
import betterproto
import pytest

from tests.coordinator.grpc_client import (
    Api,
    NodeStream,
    api_client,
    enroll,
    jobspec,
    node_stream,
)
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tests.support.store_backend import where_in
from tuneplane.coordinator.auth import JOIN_PREFIX, hash_credential, new_credential
from tuneplane.coordinator.store.core import Store
from tuneplane.proto import v1

#: Nodes in the storm: three holding members, the rest idle.
NODES = 24
PREPARED = v1.MemberState(v1.MemberState.PREPARED)
PREPARING = v1.MemberState(v1.MemberState.PREPARING)
RUNNING = v1.MemberState(v1.MemberState.RUNNING)
NO_ENROLL_LIMIT = "\n[limits]\nenroll_burst = 0\n"


def _enroll_all(coord: CoordinatorProcess) -> list[v1.EnrollReply]:
    async def go() -> list[v1.EnrollReply]:
        # Join tokens written straight into the store (the admin CLI would cost a process each).
        tokens = [new_credential(JOIN_PREFIX) for _ in range(NODES)]
        store = await Store.open(where_in(coord.state_dir))
        try:
            now = int(time.time() * 1000)
            for token in tokens:
                await store.create_join_token(hash_credential(token), "default", now, now + 600_000)
        finally:
            await store.close()
        return list(
            await asyncio.gather(
                *(
                    enroll(coord.control, coord.ca_path, t, f"storm-{i:02d}", 2)
                    for i, t in enumerate(tokens)
                )
            )
        )

    return asyncio.run(go())


@asynccontextmanager
async def _connected(
    coord: CoordinatorProcess,
    nodes: list[v1.EnrollReply],
    held: dict[str, list[v1.HeldMember]] | None = None,
) -> AsyncIterator[list[NodeStream]]:
    """Every Node's stream, all opened at once (each checks its Welcome)."""
    async with AsyncExitStack() as stack:
        streams: list[NodeStream | None] = [None] * len(nodes)

        async def one(i: int, n: v1.EnrollReply) -> None:
            streams[i] = await stack.enter_async_context(
                node_stream(
                    coord.control,
                    coord.ca_path,
                    n.node_credential,
                    n.node_id,
                    hostname=f"storm-{i:02d}",
                    held=(held or {}).get(n.node_id, []),
                )
            )

        async with anyio.create_task_group() as tg:
            for i, n in enumerate(nodes):
                tg.start_soon(one, i, n)
        yield [s for s in streams if s is not None]


async def _prepared(api: Api, node: NodeStream, project: str, reply: bool) -> v1.Prepare:
    """Submit a one-member Job; the Node gets its Prepare and (``reply``) says prepared."""
    await api.submit(jobspec(gpus=2, project=project), f"key-{project}")
    prepare: v1.Prepare = await node.expect("prepare")
    if reply:
        await node.send(
            prepare_reply=v1.PrepareReply(
                member=prepare.member,
                ok=True,
                rendezvous=v1.Rendezvous(master_addr="127.0.0.1", master_port=29500),
            )
        )
    return prepare


@pytest.mark.timeout(240)
def test_many_nodes_reconnecting_at_once_each_get_welcome_and_their_orders(
    tmp_path: Path,
) -> None:
    with start_coordinator(
        # Every Node enrolls from 127.0.0.1: the per-address Enroll limit is off.
        tmp_path,
        heartbeat_timeout=30,
        prepare_timeout=600,
        config=NO_ENROLL_LIMIT,
    ) as coord:
        nodes = _enroll_all(coord)
        a, b, c = nodes[:3]

        async def before() -> tuple[v1.Prepare, v1.Prepare, v1.Prepare]:
            # One Node at a time, so each Job lands on the Node the test chose.
            async with api_client(coord.api, coord.ca_path, coord.admin_token) as api:
                async with _connected(coord, [a]) as (node_a,):
                    committed = await _prepared(api, node_a, "committed", reply=True)
                    await node_a.expect("commit")  # the Node crashes before it says committed
                async with _connected(coord, [b]) as (node_b,):
                    undecided = await _prepared(api, node_b, "undecided", reply=False)
                async with _connected(coord, [c]) as (node_c,):
                    cancelled = await _prepared(api, node_c, "cancelled", reply=True)
                    await node_c.expect("commit")
                    await node_c.report_running(1, cancelled.member)
                    await api.wait_for_state(cancelled.member.run_id, "running")
                    await api.stub.cancel_job(
                        v1.CancelJobRequest(run_id=cancelled.member.run_id, reason="enough")
                    )
                    await node_c.expect("cancel")  # and then the coordinator dies
            return committed, undecided, cancelled

        committed, undecided, cancelled = asyncio.run(before())
        coord.kill()
        coord.restart()

        held = {
            a.node_id: [v1.HeldMember(member=committed.member, state=PREPARED)],
            b.node_id: [v1.HeldMember(member=undecided.member, state=PREPARING)],
            c.node_id: [v1.HeldMember(member=cancelled.member, state=RUNNING)],
        }

        async def storm() -> tuple[list[tuple[str, v1.MemberRef]], list[str]]:
            async with _connected(coord, nodes, held) as streams:
                owed = []
                for node, kind in zip(streams[:3], ("commit", "prepare", "cancel"), strict=True):
                    body = await node.expect(kind)
                    owed.append((kind, body.member))
                # The idle Nodes are owed nothing: a round trip on each stream shows no order
                # queued before its HeartbeatAck.
                for node in streams[3:]:
                    await node.send(heartbeat=v1.Heartbeat(seq=1))
                firsts = []
                for node in streams[3:]:
                    message = await node.stream.recv_message()
                    assert message is not None
                    firsts.append(betterproto.which_one_of(message, "body")[0])
                return owed, firsts

        owed, firsts = asyncio.run(storm())
        assert owed == [
            ("commit", committed.member),
            ("prepare", undecided.member),
            ("cancel", cancelled.member),
        ]
        assert firsts == ["heartbeat_ack"] * (NODES - 3)
        connected = coord.decisions("node connected")
        assert {d["node_id"] for d in connected} == {n.node_id for n in nodes}
