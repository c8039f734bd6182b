"""The rendezvous probe accepts nothing but this attempt's member 0 listener as proof.

Impostors are real listeners on real sockets: another attempt's listener (a wrong nonce), an
echo service, a service that answers with noise and one that never answers. Each is refused
with the sentence, and the impostor never learns the nonce: only an HMAC of a fresh challenge
crosses the wire.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from tests.agent.jobs import job, journal
from tests.coordinator.grpc_client import enroll, node_stream
from tests.faults.jobs import held_gpus, project, submit
from tests.support.agent import AgentProcess, start_agent
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tuneplane.agent import rendezvous as rdv
from tuneplane.proto import v1

NONCE = "5" * 64
OTHER_NONCE = "6" * 64


async def _refused(port: int) -> str:
    with trio.fail_after(20), pytest.raises(rdv.Unreachable) as refused:
        await rdv.probe("127.0.0.1", port, NONCE, timeout_s=1.5)
    return str(refused.value)


async def test_another_attempts_listener_is_not_proof() -> None:
    async with trio.open_nursery() as nursery:
        impostor = await rdv.open_listener(nursery, "127.0.0.1", OTHER_NONCE)
        sentence = await _refused(impostor.port)
        assert f"127.0.0.1:{impostor.port}" in sentence
        assert "did not prove the attempt's nonce" in sentence
        # The real listener on a port is accepted, so the refusal is the nonce's doing.
        real = await rdv.open_listener(nursery, "127.0.0.1", NONCE)
        with trio.fail_after(20):
            await rdv.probe("127.0.0.1", real.port, NONCE)
        await impostor.aclose()
        await real.aclose()


async def _impostor(
    nursery: trio.Nursery, reply: Callable[[bytes], bytes | None]
) -> tuple[int, list[bytes]]:
    """A TCP service that reads one probe's worth of bytes and answers ``reply(request)``
    (None: says nothing and keeps the connection open)."""
    heard: list[bytes] = []
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")

    async def handle(stream: trio.SocketStream) -> None:
        data = b""
        while len(data) < rdv.REQUEST_BYTES:
            chunk = await stream.receive_some(rdv.REQUEST_BYTES - len(data))
            if not chunk:
                break
            data += chunk
        heard.append(data)
        answer = reply(data)
        if answer is None:
            await trio.sleep_forever()
        await stream.send_all(answer)
        await stream.aclose()

    nursery.start_soon(trio.serve_listeners, handle, listeners)
    port = listeners[0].socket.getsockname()[1]
    return int(port), heard


@pytest.mark.parametrize(
    ("name", "reply", "words"),
    [
        ("echo", lambda data: data[len(rdv.MAGIC) :], "did not prove the attempt's nonce"),
        ("noise", lambda data: bytes(32), "did not prove the attempt's nonce"),
        ("short", lambda data: b"OK\n", "did not prove the attempt's nonce"),
        ("silent", lambda data: None, "it did not answer in time"),
    ],
)
async def test_a_service_that_is_not_the_listener_is_not_proof(
    name: str, reply: Callable[[bytes], bytes | None], words: str
) -> None:
    async with trio.open_nursery() as nursery:
        port, heard = await _impostor(nursery, reply)
        sentence = await _refused(port)
        assert f"127.0.0.1:{port}" in sentence, name
        assert words in sentence, (name, sentence)
        assert heard, "the probe reached the impostor"
        for request in heard:
            assert NONCE.encode() not in request  # the nonce never crosses the wire
        nursery.cancel_scope.cancel()


# --- with real processes: an impostor member 0 cannot get a real Node to start -----------------


async def _echo_impostor() -> tuple[asyncio.Server, int, list[bytes]]:
    """A TCP service that answers a probe with the challenge it was sent (the right length,
    the wrong proof), as a service that happens to hold the port might."""
    heard: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            data = await reader.readexactly(rdv.REQUEST_BYTES)
        except asyncio.IncompleteReadError:
            writer.close()
            return
        heard.append(data)
        writer.write(data[len(rdv.MAGIC) :])
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = int(server.sockets[0].getsockname()[1])
    return server, port, heard


async def _impostor_as_member_0(
    coord: CoordinatorProcess, agent: AgentProcess, tmp_path: Path
) -> None:
    # Members are indexed by Node id: enroll until the impostor's id sorts before the agent's.
    for _ in range(64):
        enrolled = await enroll(
            coord.control, coord.ca_path, coord.create_join_token(), "impostor", 1
        )
        if enrolled.node_id < agent.node_id:
            break
    else:
        raise AssertionError("no enrolled id sorted before the agent's in 64 tries")
    server, port, heard = await _echo_impostor()
    async with server, node_stream(
        coord.control, coord.ca_path, enrolled.node_credential, enrolled.node_id,
        hostname="impostor", gpus=1,
    ) as node:  # fmt: skip
        root = await asyncio.to_thread(
            project, coord, tmp_path / "proj", "pytorch/process-group", {"train.py": "pass\n"}
        )
        run_id = await asyncio.to_thread(submit, coord, root, "h200:2", "--members", "2")
        prepare: v1.Prepare = await node.expect("prepare", timeout=60)
        assert prepare.member.run_id == run_id and prepare.member.member_index == 0
        assert prepare.pick_rendezvous and len(prepare.rendezvous_nonce) == 64
        nonce = prepare.rendezvous_nonce
        await node.send(
            prepare_reply=v1.PrepareReply(
                member=prepare.member,
                ok=True,
                rendezvous=v1.Rendezvous(master_addr="127.0.0.1", master_port=port),
                rendezvous_held=True,  # it says so: what it says proves nothing
            )
        )
        abort: v1.Abort = await node.expect("abort", timeout=60)
    assert f"member 1 on Node {agent.node_id} refused Prepare" in abort.reason, abort.reason
    assert f"cannot reach the rendezvous 127.0.0.1:{port}" in abort.reason, abort.reason
    assert "did not prove the attempt's nonce" in abort.reason, abort.reason
    assert heard and all(nonce.encode() not in request for request in heard)

    # Nothing changed on the real Node: its member was refused, never started, holds no GPU.
    shown = await asyncio.to_thread(job, coord, run_id)
    assert shown["state"] == "aborted", shown
    members = [m for m in journal(agent, "members", "--json") if m["run_id"] == run_id]
    assert [(m["member_index"], m["state"]) for m in members] == [(1, "aborted")]
    assert not (Path(members[0]["member_dir"]) / "runner.json").exists()
    assert not held_gpus(agent)


def test_an_impostor_member_0_is_refused_by_a_real_node(tmp_path: Path) -> None:
    # The impostor sends no heartbeats: the coordinator gives it a minute.
    with start_coordinator(tmp_path, heartbeat_timeout=60) as coord:
        agent = start_agent(tmp_path, coord, "node-real", "h200:1")
        try:
            agent.wait_connected()
            asyncio.run(_impostor_as_member_0(coord, agent, tmp_path))
        finally:
            agent.stop()
