"""Bounded input (issue 8, must have 7), against a real coordinator over loopback TLS.

Each listener refuses a message over its size limit from the 5-byte length prefix, before reading
or decoding it; Enroll is rate-limited per address and its inventory bounded by count; and while a
hostile 50 MB request is being sent and refused, ListFleets and heartbeats are still answered
within a second. Every refusal is checked together with "nothing changed".
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import betterproto
import pytest
from grpclib import GRPCError
from grpclib.const import Status

from tests.collector.delivery import launch_member
from tests.coordinator.grpc_client import (
    bearer,
    enroll,
    job_ids,
    node_ids,
    node_stream,
    open_channel,
)
from tests.security.raw_calls import Outcome, call, frame
from tests.support.coordinator import CoordinatorProcess, start_coordinator
from tuneplane.coordinator.config import DEFAULT_CONFIG, ConfigError, Limits, parse_config
from tuneplane.coordinator.gateways.bounded_decode import (
    COUNT_RULES,
    ENTRY_BYTES,
    MAX_HELD_MEMBERS,
    MAX_INVENTORY_GPUS,
    TooMany,
    check_counts,
)
from tuneplane.coordinator.gateways.rate_limit import PeerRateLimit
from tuneplane.proto import v1

ENROLL = "/tuneplane.v1.Control/Enroll"
PREVIEW = "/tuneplane.v1.Api/Preview"
PING = "/tuneplane.v1.Telemetry/Ping"
HOSTILE_BYTES = 50 * 1000 * 1000
HOSTILE_RUNS = 5
ANSWER_WITHIN_S = 1.0


def coordinator_with_limits(root: Path, limits: str) -> CoordinatorProcess:
    """``init``, then a ``[limits]`` table in coordinator.toml, then ``serve``."""
    return start_coordinator(
        root, heartbeat_interval=0.5, heartbeat_timeout=5, config="\n[limits]\n" + limits
    )


@pytest.fixture(scope="module")
def coord(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    with coordinator_with_limits(
        tmp_path_factory.mktemp("bounded"), "enroll_burst = 1000\nenroll_per_second = 100\n"
    ) as c:
        yield c


def _hostname_enroll(size: int) -> bytes:
    """An EnrollRequest whose hostname (field 2) makes it ``size`` bytes or a few more."""
    return frame(1, b"tpj-hostile") + frame(2, b"h" * size)


def test_a_50_mb_request_is_refused_while_list_fleets_and_heartbeats_are_answered(
    coord: CoordinatorProcess,
) -> None:
    token = coord.create_join_token()
    node = asyncio.run(enroll(coord.control, coord.ca_path, token, "node-probe", 2))
    hostile = _hostname_enroll(HOSTILE_BYTES)

    async def scenario() -> tuple[list[Outcome], list[float], list[float]]:
        refusals: list[Outcome] = []
        fleets_s: list[float] = []
        beats_s: list[float] = []
        done = asyncio.Event()
        channel = open_channel(coord.api, coord.ca_path)
        api = v1.ApiStub(channel, metadata=bearer(coord.admin_token), timeout=10)
        try:
            async with node_stream(
                coord.control, coord.ca_path, node.node_credential, node.node_id
            ) as stream:

                async def probe() -> None:
                    seq = 0
                    while not done.is_set():
                        started = time.perf_counter()
                        await api.list_fleets(v1.ListFleetsRequest())
                        fleets_s.append(time.perf_counter() - started)
                        seq += 1
                        started = time.perf_counter()
                        await stream.send(heartbeat=v1.Heartbeat(seq=seq, sent_at_ms=0))
                        while True:
                            message = await stream.stream.recv_message()
                            assert message is not None, "the coordinator ended the Node's stream"
                            if message.heartbeat_ack.seq == seq:
                                break
                        beats_s.append(time.perf_counter() - started)
                        await asyncio.sleep(0.02)

                async def attack() -> None:
                    try:
                        for _ in range(HOSTILE_RUNS):
                            refusals.append(
                                await call(coord.control, coord.ca_path, ENROLL, hostile)
                            )
                    finally:
                        done.set()

                await asyncio.wait_for(asyncio.gather(probe(), attack()), timeout=120)
        finally:
            channel.close()
        return refusals, fleets_s, beats_s

    refusals, fleets_s, beats_s = asyncio.run(scenario())
    for outcome in refusals:
        assert outcome.status == Status.RESOURCE_EXHAUSTED, outcome
        assert "65536 bytes" in outcome.message and "enroll_message_bytes" in outcome.message
    assert fleets_s and beats_s
    assert max(fleets_s) < ANSWER_WITHIN_S, fleets_s
    assert max(beats_s) < ANSWER_WITHIN_S, beats_s
    median = statistics.median(o.seconds for o in refusals)
    print(
        f"hostile 50 MB Enroll refused: median {median * 1000:.0f} ms over {len(refusals)} runs; "
        f"while it ran, ListFleets max {max(fleets_s) * 1000:.0f} ms ({len(fleets_s)} calls), "
        f"heartbeat ack max {max(beats_s) * 1000:.0f} ms ({len(beats_s)} beats)"
    )
    # Nothing changed: only the probing Node is enrolled, and the coordinator still serves.
    assert asyncio.run(node_ids(coord)) == [node.node_id]
    assert "Traceback" not in coord.read_log()


def test_each_listener_refuses_a_message_over_its_limit(coord: CoordinatorProcess) -> None:
    # The telemetry listener answers only a collector credential: a real one, from a Commit.
    collector = launch_member(coord, "oversize-ping").credential
    before = asyncio.run(job_ids(coord))
    preview = frame(1, b"{" + b" " * (17 * 1024 * 1024) + b"}")
    api = asyncio.run(call(coord.api, coord.ca_path, PREVIEW, preview, coord.admin_token))
    assert api.status == Status.RESOURCE_EXHAUSTED, api
    assert "16777216 bytes" in api.message and "api_message_bytes" in api.message
    ping = asyncio.run(
        call(coord.telemetry, coord.ca_path, PING, frame(15, b"x" * (4 << 20)), collector)
    )
    assert ping.status == Status.RESOURCE_EXHAUSTED, ping
    assert "3145728 bytes" in ping.message and "telemetry_message_bytes" in ping.message
    assert asyncio.run(job_ids(coord)) == before


def test_an_inventory_with_too_many_gpus_is_refused_before_decoding(
    coord: CoordinatorProcess,
) -> None:
    before = asyncio.run(node_ids(coord))
    token = coord.create_join_token()
    gpus = b"".join(frame(4, b"") for _ in range(MAX_INVENTORY_GPUS + 1))
    body = frame(1, token.encode()) + frame(3, gpus)
    refused = asyncio.run(call(coord.control, coord.ca_path, ENROLL, body))
    assert refused.status == Status.RESOURCE_EXHAUSTED, refused
    assert f"EnrollRequest.inventory.gpus holds more than {MAX_INVENTORY_GPUS}" in refused.message
    assert asyncio.run(node_ids(coord)) == before
    # The refused call did not spend the join token: the same token still enrolls a real Node.
    node = asyncio.run(enroll(coord.control, coord.ca_path, token, "node-after", 8))
    assert asyncio.run(node_ids(coord)) == sorted([*before, node.node_id])


def test_every_counted_field_takes_at_least_two_bytes_an_entry() -> None:
    """check_counts skips a message too short to break a bound, which holds only while every
    counted field is length-delimited (a packed number could take one byte an entry)."""
    for message_type, rules in COUNT_RULES.items():
        for dotted, _, _ in rules:
            current: Any = message_type
            for name in dotted.split("."):
                meta = current._betterproto
                kind = meta.meta_by_field_name[name].proto_type
                current = meta.cls_by_field.get(name, current)
            assert kind in ("message", "string", "bytes"), (message_type.__name__, dotted, kind)
    assert len(frame(9, b"")) == ENTRY_BYTES


def test_the_shortest_message_over_a_bound_is_still_counted_and_refused() -> None:
    held = frame(4, b"")  # Hello.held: one empty HeldMember, two bytes
    just = frame(1, held * MAX_HELD_MEMBERS)  # NodeMessage.hello
    check_counts(just, v1.NodeMessage)
    over = frame(1, held * (MAX_HELD_MEMBERS + 1))
    assert len(over) > ENTRY_BYTES * (MAX_HELD_MEMBERS + 1)
    with pytest.raises(TooMany, match=f"hello.held holds more than {MAX_HELD_MEMBERS}"):
        check_counts(over, v1.NodeMessage)


def test_enroll_is_rate_limited_per_address(tmp_path: Path) -> None:
    with coordinator_with_limits(tmp_path, "enroll_burst = 3\nenroll_per_second = 0.001\n") as c:
        bogus = bytes(v1.EnrollRequest(join_token="tpj-not-a-token", hostname="x"))
        for _ in range(3):
            answer = asyncio.run(call(c.control, c.ca_path, ENROLL, bogus))
            assert answer.status in (Status.UNAUTHENTICATED, Status.PERMISSION_DENIED), answer
        token = c.create_join_token()
        real = bytes(v1.EnrollRequest(join_token=token, hostname="late"))
        limited = asyncio.run(call(c.control, c.ca_path, ENROLL, real))
        assert limited.status == Status.RESOURCE_EXHAUSTED, limited
        assert "Too many Enroll calls from 127.0.0.1; retry in" in limited.message
        assert asyncio.run(node_ids(c)) == []
        assert "enroll refused: rate limit peer=127.0.0.1" in c.read_log()


def test_the_token_bucket_allows_a_burst_then_the_rate() -> None:
    limit = PeerRateLimit(burst=3, per_second=0.5)
    assert [limit.take("10.0.0.1", 100.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limit.take("10.0.0.1", 100.0) == pytest.approx(2.0)  # one token every 2 s
    assert limit.take("10.0.0.2", 100.0) == 0.0  # another address has its own bucket
    assert limit.take("10.0.0.1", 101.0) == pytest.approx(1.0)
    assert limit.take("10.0.0.1", 102.0) == 0.0
    assert limit.take("10.0.0.1", 50.0) > 0  # a clock that goes back refills nothing
    assert PeerRateLimit(burst=0, per_second=0).take("x", 0.0) == 0.0  # burst 0: no limit


def test_the_table_of_peers_is_bounded() -> None:
    limit = PeerRateLimit(burst=1, per_second=0.001, max_peers=100)
    for i in range(1000):
        limit.take(f"10.0.{i // 256}.{i % 256}", 0.0)
    assert len(limit) == 100
    assert limit.take("10.0.3.231", 0.0) > 0  # among the most recent: still limited


@pytest.mark.parametrize(
    ("line", "named"),
    [
        ("api_message_bytes = 10", "must be a whole number of bytes from 1024"),
        ('control_message_bytes = "4 MiB"', "control_message_bytes = '4 MiB'"),
        ("enroll_burst = -1", "enroll_burst = -1 must be a whole number from 0"),
        ("enroll_per_second = true", "enroll_per_second = True must be a number"),
        ("enroll_rate = 3", "unknown key(s) enroll_rate"),
        ("connects_at_once = 0", "connects_at_once = 0 must be a whole number from 1"),
        ("connect_wait_s = 12", "a Node gives up on its Welcome after 10 s"),
        ('connect_wait_s = "5s"', "connect_wait_s = '5s' must be a number of seconds"),
        ("connect_queue_s = 61", "a Node in line waits for its Welcome at most 120 s"),
        ("connect_queue_s = -1", "connect_queue_s = -1 must be a number of seconds from 0"),
    ],
)
def test_a_wrong_limit_is_a_config_error_naming_the_key(line: str, named: str) -> None:
    text = DEFAULT_CONFIG + "\n[limits]\n" + line + "\n"
    with pytest.raises(ConfigError) as caught:
        parse_config(text, Path("coordinator.toml"))
    assert named in str(caught.value) and "coordinator.toml" in str(caught.value)
    assert parse_config(DEFAULT_CONFIG, Path("c.toml")).limits == Limits()


def test_an_oversized_message_on_a_node_stream_ends_that_session_only(
    coord: CoordinatorProcess,
) -> None:
    token = coord.create_join_token()
    node = asyncio.run(enroll(coord.control, coord.ca_path, token, "node-big", 1))
    chunk = v1.LogChunk(
        member=v1.MemberRef(run_id="run-x", attempt=1), stream="stdout", data=b"x" * (5 << 20)
    )

    async def oversized() -> GRPCError:
        with pytest.raises(GRPCError) as caught:
            async with node_stream(
                coord.control, coord.ca_path, node.node_credential, node.node_id
            ) as stream:
                await stream.send(log_chunk=chunk)
                await stream.recv(timeout=30)
        return caught.value

    refused = asyncio.run(oversized())
    assert refused.status == Status.RESOURCE_EXHAUSTED, refused
    assert "4194304 bytes" in (refused.message or "") and "control_message_bytes" in (
        refused.message or ""
    )

    async def again() -> str:
        async with node_stream(
            coord.control, coord.ca_path, node.node_credential, node.node_id
        ) as stream:
            await stream.send(heartbeat=v1.Heartbeat(seq=1))
            message = await stream.stream.recv_message()
            return str(betterproto.which_one_of(message, "body")[0])

    assert asyncio.run(again()) == "heartbeat_ack"
