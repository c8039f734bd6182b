"""A real multi-host install: the coordinator and each Node in a network namespace of its own.

Rules: every host has its own address on a bridge (tests/support/netns.py), names resolve
through the namespace's hosts file, and a lost link is made by taking an interface down, never
by killing a process. Needs root and ``ip netns``; skips with a sentence otherwise (fails under
``CI=true``).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.netns import open_network, require_netns

pytestmark = pytest.mark.slow

_LISTEN = """
import socket, sys
s = socket.socket()
s.bind(("0.0.0.0", 0))
s.listen()
print(s.getsockname()[1], flush=True)
conn, peer = s.accept()
print(peer[0], conn.recv(16).decode(), flush=True)
"""

_DIAL = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5) as c:
    c.sendall(b"hello")
"""


def test_hosts_reach_each_other_by_name_and_a_cut_link_heals() -> None:
    require_netns("to give each host an address of its own")
    with open_network(["alpha", "beta"]) as net:
        alpha, beta = net.host("alpha"), net.host("beta")
        assert (alpha.address, beta.address) == ("10.77.0.1", "10.77.0.2")
        # The machine's own namespace holds none of these addresses.
        own = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True)
        assert "10.77.0." not in own.stdout
        listener = subprocess.Popen(
            alpha.argv(sys.executable, "-c", _LISTEN), stdout=subprocess.PIPE, text=True
        )
        try:
            assert listener.stdout is not None
            port = listener.stdout.readline().strip()
            dialled = beta.run(sys.executable, "-c", _DIAL, "alpha", port)
            assert dialled.returncode == 0, dialled.stderr
            out, _ = listener.communicate(timeout=10)
            assert out.split() == ["10.77.0.2", "hello"]
        finally:
            if listener.poll() is None:
                listener.kill()
            listener.wait()
        beta.cut()
        refused = beta.run(sys.executable, "-c", _DIAL, "alpha", port)
        assert refused.returncode != 0
        beta.heal()
        up = beta.run("ip", "-o", "addr", "show", "dev", "eth0")
        assert "10.77.0.2/24" in up.stdout
        names = [
            line.split()[0]
            for line in subprocess.run(
                ["ip", "netns", "list"], capture_output=True, text=True, check=True
            ).stdout.splitlines()
        ]
        assert alpha.netns in names and beta.netns in names
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    assert alpha.netns not in after.stdout and net.switch not in after.stdout
