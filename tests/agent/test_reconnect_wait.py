"""The wait between two rounds of dials (agent/reconnect_wait.py) against real loopback sockets:
a listener that appears mid-backoff ends the wait at once, one that accepted all along does not,
and a replaced credential ends it too. No fixed sleeps: the test learns that a probe sweep saw
the port refuse through the jitter the wait draws after each sweep."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from tuneplane.agent import reconnect_wait as rw

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def closed_port() -> Iterator[socket.socket]:
    """A bound loopback port that is not listening yet: a connect to it is refused at once."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    try:
        yield sock
    finally:
        sock.close()


def _address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"{host}:{port}"


class Sweeps:
    """Counts the probe sweeps that found nothing (the wait draws a jitter after each)."""

    def __init__(self) -> None:
        self.count = 0
        self.event = trio.Event()

    def __call__(self) -> float:
        self.count += 1
        self.event.set()
        return 0.5


async def test_a_port_that_starts_accepting_mid_backoff_ends_the_wait_within_a_second(
    closed_port: socket.socket, tmp_path: Path
) -> None:
    address = _address(closed_port)
    credential = tmp_path / "control.token"
    credential.write_text("t\n")
    sweeps = Sweeps()
    found: list[tuple[str, float]] = []

    async def wait() -> None:
        back = await rw.wait_to_redial(60.0, ("127.0.0.1:1", address), credential, sweeps)
        found.append((back, trio.current_time()))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait)
        await sweeps.event.wait()  # a sweep saw both refuse
        closed_port.listen(1)
        opened_at = trio.current_time()
    ((back, at),) = found
    assert back == address
    assert at - opened_at < 1.0, f"the wait went on {at - opened_at:.2f} s after the port opened"


async def test_a_port_that_accepted_all_along_does_not_cut_the_wait_short(
    closed_port: socket.socket, tmp_path: Path
) -> None:
    # It refused the session, not the connection: only the backoff paces a coordinator that
    # says no, or a Fleet would hammer it every half second.
    closed_port.listen(4)
    credential = tmp_path / "control.token"
    credential.write_text("t\n")
    sweeps = Sweeps()
    started = trio.current_time()
    back = await rw.wait_to_redial(1.2, (_address(closed_port),), credential, sweeps)
    assert back == ""
    assert trio.current_time() - started >= 1.2
    # One probe told it all: the coordinator saying no is not probed again in this wait.
    assert sweeps.count == 1
    closed_port.setblocking(False)
    accepted = []
    with pytest.raises(BlockingIOError):
        while True:
            accepted.append(closed_port.accept()[0])
    for sock in accepted:
        sock.close()
    assert len(accepted) == 1


async def test_a_probe_holds_no_connection_open(closed_port: socket.socket) -> None:
    closed_port.listen(4)
    assert await rw.accepts(_address(closed_port))
    accepted, _peer = closed_port.accept()
    with accepted:
        # The probe sent nothing and closed: the accepted side reads end-of-stream at once.
        accepted.settimeout(5)
        assert accepted.recv(16) == b""


async def test_a_replaced_credential_ends_the_wait(
    closed_port: socket.socket, tmp_path: Path
) -> None:
    credential = tmp_path / "control.token"
    credential.write_text("old\n")
    sweeps = Sweeps()
    done: list[str] = []

    async def wait() -> None:
        done.append(await rw.wait_to_redial(60.0, (_address(closed_port),), credential, sweeps))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await sweeps.event.wait()
            fresh = tmp_path / "control.token.next"
            fresh.write_text("new\n")
            os.replace(fresh, credential)
    assert done == [""]


async def test_an_address_that_is_not_host_port_or_unresolvable_is_not_accepting() -> None:
    assert not await rw.accepts("not-an-address")
    assert not await rw.accepts("127.0.0.1:1")
