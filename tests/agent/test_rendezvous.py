"""The rendezvous check (agent/rendezvous.py) over real loopback sockets: the handshake, the
listener that holds the port, the probe and its refusal sentence, and the interface lookup."""

from __future__ import annotations

import socket

import pytest
import trio

from tuneplane.agent import rendezvous as rdv

NONCE = "a" * 64


def test_the_answer_proves_the_nonce_and_the_challenge() -> None:
    challenge = rdv.new_challenge()
    reply = rdv.answer(NONCE, challenge)
    assert rdv.answer_proves(NONCE, challenge, reply)
    assert not rdv.answer_proves("b" * 64, challenge, reply)
    assert not rdv.answer_proves(NONCE, rdv.new_challenge(), reply)
    assert not rdv.answer_proves(NONCE, challenge, reply[:-1])
    # An echo of the request proves nothing.
    assert not rdv.answer_proves(NONCE, challenge, rdv.probe_request(challenge)[:32])


def test_only_a_whole_probe_request_is_read_as_one() -> None:
    challenge = rdv.new_challenge()
    assert rdv.read_request(rdv.probe_request(challenge)) == challenge
    assert rdv.read_request(b"GET / HTTP/1.1\r\n" + bytes(24)) is None
    assert rdv.read_request(rdv.probe_request(challenge)[:-1]) is None
    with pytest.raises(ValueError, match="32 bytes"):
        rdv.probe_request(b"short")


def test_an_address_maps_to_the_interface_that_holds_it() -> None:
    interfaces = {"eth0": ["10.0.0.5", "fe80::1%eth0"], "lo": ["127.0.0.1", "::1"]}
    assert rdv.interface_of("10.0.0.5", interfaces) == "eth0"
    assert rdv.interface_of("fe80::1", interfaces) == "eth0"
    assert rdv.interface_of("127.0.0.1", interfaces) == "lo"
    assert rdv.interface_of("192.0.2.1", interfaces) == ""


def test_the_kernel_routes_loopback_through_lo() -> None:
    route = rdv.route_to("127.0.0.1")
    assert route is not None
    assert route.local_address == "127.0.0.1"
    assert route.interface == rdv.interface_of("127.0.0.1", rdv.local_interfaces())
    assert route.interface  # the loopback interface has a name (lo on Linux)


def test_ifname_variables_name_the_route_unless_the_job_sets_them() -> None:
    lo = rdv.interface_of("127.0.0.1", rdv.local_interfaces())
    assert rdv.ifname_env("127.0.0.1", {}) == {
        "NCCL_SOCKET_IFNAME": lo,
        "GLOO_SOCKET_IFNAME": lo,
    }
    assert rdv.ifname_env("127.0.0.1", {"NCCL_SOCKET_IFNAME": "ib0"}) == {"GLOO_SOCKET_IFNAME": lo}
    both = {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "eth1"}
    assert rdv.ifname_env("127.0.0.1", both) == {}


def test_the_test_address_variable_replaces_the_advertised_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(rdv.TEST_ADDRESS_VARIABLE, raising=False)
    assert rdv.advertised_address("10.1.2.3") == "10.1.2.3"
    monkeypatch.setenv(rdv.TEST_ADDRESS_VARIABLE, "192.0.2.1")
    assert rdv.advertised_address("10.1.2.3") == "192.0.2.1"


async def test_a_probe_reaches_the_listener_and_the_port_is_free_once_released() -> None:
    async with trio.open_nursery() as nursery:
        listener = await rdv.open_listener(nursery, "127.0.0.1", NONCE)
        assert listener.port > 0
        # The port is held: nobody else can bind it meanwhile.
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", listener.port))
        with trio.fail_after(20):
            route = await rdv.probe("127.0.0.1", listener.port, NONCE)
            # Something that is not a probe is hung up on; the listener keeps answering.
            stream = await trio.open_tcp_stream("127.0.0.1", listener.port)
            await stream.send_all(b"GET / HTTP/1.1\r\n\r\n" + bytes(40))
            try:
                got = await stream.receive_some(100)
            except trio.BrokenResourceError:
                got = b""  # hung up with the request unread: a reset, no answer either
            assert got == b""
            await stream.aclose()
            await rdv.probe("127.0.0.1", listener.port, NONCE)
        assert route.local_address == "127.0.0.1"
        await listener.aclose()
        await listener.aclose()  # idempotent
        # Rank 0 binds the port the moment the listener lets go of it (as servers do).
        with socket.create_server(("127.0.0.1", listener.port)):
            pass


async def test_a_probe_of_a_closed_port_is_refused_with_address_port_and_interface() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]  # bound, never listening: connections are refused
        with trio.fail_after(20), pytest.raises(rdv.Unreachable) as refused:
            await rdv.probe("127.0.0.1", port, NONCE, timeout_s=1.0)
    sentence = str(refused.value)
    lo = rdv.interface_of("127.0.0.1", rdv.local_interfaces())
    assert f"127.0.0.1:{port}" in sentence
    assert f"from interface {lo} (local address 127.0.0.1)" in sentence
    assert "the connection was refused" in sentence
    assert sentence.endswith("then retry the Job.")
